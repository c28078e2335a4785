"""Prompt logprobs (vLLM's prompt_logprobs=N) equal transformers' log_softmax of the prompt in every situation."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_prompts
from helpers import greedy
from tapllm import LLM, SamplingParams

TOP = 3


def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [p, vocab]


def _check(out, ref: torch.Tensor, prompt: list[int]) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        entry = plp[i]
        got = entry[prompt[i]]
        assert abs(got.logprob - float(row[prompt[i]])) < 1e-4
        # The rank counts tokens scored above it; tokens within float noise of it (another CPU's
        # kernels round differently) may fall on either side, deep in the vocabulary especially.
        above, near = int((row > row[prompt[i]] + 1e-5).sum()), int((row > row[prompt[i]] - 1e-5).sum())
        assert above + 1 <= got.rank <= near + 1
        vals, ids = row.topk(TOP)
        for r, (v, t) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            assert t in entry and abs(entry[t].logprob - v) < 1e-4
            if t != prompt[i]:
                assert entry[t].rank == r
        assert got.decoded_token is not None


@pytest.fixture(scope="module")
def setup(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32).eval()
    prompts = random_prompts([2, 9, 30, 45], seed=13)
    refs = [_hf_prompt_logprobs(model, p) for p in prompts]
    return prompts, refs


@pytest.mark.parametrize("engine_kwargs", [
    {},  # batched
    {"max_num_batched_tokens": 7},  # chunked prefill
    {"block_size": 4, "kv_cache_blocks": 24, "enable_prefix_caching": False},  # preemption
])
def test_prompt_logprobs_match_transformers(tiny_models, setup, engine_kwargs):
    prompts, refs = setup
    llm = LLM(tiny_models["qwen2"], dtype="float32", **engine_kwargs)
    outs = llm.generate(prompts, greedy(4, prompt_logprobs=TOP), use_tqdm=False)
    for p, out, ref in zip(prompts, outs, refs):
        _check(out, ref, p)
    if "kv_cache_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    single = llm.generate([prompts[2]], greedy(4, prompt_logprobs=TOP), use_tqdm=False)[0]  # alone
    _check(single, refs[2], prompts[2])


def test_prompt_logprobs_after_a_prefix_cache_hit(tiny_models, setup):
    prompts, refs = setup
    llm = LLM(tiny_models["qwen2"], dtype="float32", block_size=4)
    plain = SamplingParams(max_tokens=2, temperature=0)
    llm.generate(prompts, plain, use_tqdm=False)
    again = llm.generate(prompts, plain, use_tqdm=False)
    assert any(o.metrics["num_cached_tokens"] > 0 for o in again)  # others keep their hits
    outs = llm.generate(prompts, greedy(4, prompt_logprobs=TOP), use_tqdm=False)  # these recompute the cached positions
    for p, out, ref in zip(prompts, outs, refs):
        _check(out, ref, p)


def test_perplexity_in_one_call(tiny_models, setup):
    prompts, refs = setup
    llm = LLM(tiny_models["qwen2"], dtype="float32")
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    nll = -sum(entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompts[3][1:])) / (len(prompts[3]) - 1)
    want = -float(refs[3][torch.arange(len(prompts[3]) - 1), torch.tensor(prompts[3][1:])].mean())
    assert math.isclose(nll, want, rel_tol=1e-5)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])  # prompt_logprobs=0: the token alone
    with pytest.raises(ValueError, match="prompt_logprobs.*max_logprobs"):
        llm.generate([prompts[3]], SamplingParams(prompt_logprobs=21), use_tqdm=False)
