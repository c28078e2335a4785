"""Greedy tokens and logprobs equal Hugging Face transformers in every batching situation."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy, random_prompts
from helpers import greedy
from tapllm import LLM, SamplingParams

LENGTHS = [1, 3, 9, 16, 17, 34, 61, 97]
NEW = 12
ARCHS = ["llama", "llama3-rope-tied", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def references(tiny_models):
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(LENGTHS)
    shared = random_prompts([40], seed=7)[0]  # a long shared prefix for prefix caching
    prefixed = [shared + p for p in random_prompts([5, 11, 20, 2], seed=8)]
    refs = {}
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
        refs[arch] = {
            "prompts": [hf_greedy(model, p, NEW) for p in prompts],
            "prefixed": [hf_greedy(model, p, NEW) for p in prefixed],
        }
    return prompts, prefixed, refs


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_every_situation(arch, tiny_models, references):
    prompts, prefixed, refs = references
    ref = refs[arch]["prompts"]
    path = tiny_models[arch]
    if arch == "mistral":
        assert len(list(path.glob("*.safetensors"))) > 1  # loaded through the shard index

    llm = LLM(path, dtype="float32")
    # (a) one at a time
    assert_matches_reference([llm.generate([p], greedy(NEW, logprobs=0), use_tqdm=False)[0] for p in prompts], ref)
    # (b) all together
    assert_matches_reference(llm.generate(prompts, greedy(NEW, logprobs=0), use_tqdm=False), ref)

    # (c) a token budget that forces chunked prefill (and mixes chunks with decodes)
    chunked = LLM(path, dtype="float32", max_num_batched_tokens=8, enable_prefix_caching=False)
    assert_matches_reference(chunked.generate(prompts, greedy(NEW, logprobs=0), use_tqdm=False), ref)

    # (d) prefix-cache hits: a shared 40-token prefix, run twice
    cached = LLM(path, dtype="float32", block_size=8)
    first = cached.generate(prefixed, greedy(NEW, logprobs=0), use_tqdm=False)
    second = cached.generate(prefixed, greedy(NEW, logprobs=0), use_tqdm=False)
    assert_matches_reference(first, refs[arch]["prefixed"])
    assert_matches_reference(second, refs[arch]["prefixed"])
    assert all(o.metrics["num_cached_tokens"] >= 40 for o in second)

    # (e) a KV cache small enough to force preemption
    small = LLM(path, dtype="float32", block_size=8, kv_cache_blocks=20, enable_prefix_caching=False)
    assert_matches_reference(small.generate(prompts, greedy(NEW, logprobs=0), use_tqdm=False), ref)
    assert small.engine.scheduler.num_preemptions > 0

    # (e') preemption together with prefix caching and chunking
    mixed = LLM(path, dtype="float32", block_size=8, kv_cache_blocks=20, max_num_batched_tokens=24)
    assert_matches_reference(mixed.generate(prompts + prompts[:3], greedy(NEW, logprobs=0), use_tqdm=False),
                             ref + ref[:3])
    assert mixed.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_transformers_first_tokens(dtype, tiny_models):
    """Half-precision runs agree with transformers in the same dtype on the first greedy tokens."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts([5, 23, 40], seed=12)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=getattr(torch, dtype)).eval()
    llm = LLM(tiny_models["qwen3"], dtype=dtype)
    assert llm.engine.model_config.dtype == getattr(torch, dtype)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids[0] == hf_greedy(model, prompt, 1)[0][0]
        assert len(out.outputs[0].token_ids) == 3
