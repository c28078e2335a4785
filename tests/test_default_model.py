"""End-to-end checks on the real default model (SmolLM2-135M-Instruct from its GGUF file)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy
from tapllm import LLM, SamplingParams
from tapllm.loader import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Translate to French: The weather is nice today.",
    "Question: What is the boiling point of water at sea level in Celsius? Answer:",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP "
    "through a process called cellular respiration, which has three main stages: glycolysis,",
]
NEW = 10


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens from transformers loading the very same GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, [hf_greedy(model, p, NEW) for p in ids]


def test_default_model_parity(reference):
    ids, refs = reference
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(dtype="float32")
    assert llm.engine.model_config.num_layers == 30
    # The same prompts as strings tokenize like transformers' GGUF tokenizer does.
    assert [o.prompt_token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == ids
    assert_matches_reference([llm.generate([p], params, use_tqdm=False)[0] for p in ids], refs)  # (a)
    assert_matches_reference(llm.generate(ids, params, use_tqdm=False), refs)  # (b)
    assert_matches_reference(llm.generate(ids, params, use_tqdm=False), refs)  # (d) every prompt now a cache hit
    chunked = LLM(dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False)
    assert_matches_reference(chunked.generate(ids, params, use_tqdm=False), refs)  # (c)
    small = LLM(dtype="float32", block_size=4, kv_cache_blocks=14, enable_prefix_caching=False)
    assert_matches_reference(small.generate(ids, params, use_tqdm=False), refs)  # (e)
    assert small.engine.scheduler.num_preemptions > 0


def test_gguf_conversion_is_cached_and_logged(caplog):
    import logging

    from tapllm.loader import resolve_model

    with caplog.at_level(logging.INFO, logger="tapllm"):
        folder = resolve_model(None)
    assert "loading cached dequantized weights" in caplog.text
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def test_default_model_chat_and_bf16():
    llm = LLM(dtype="bfloat16")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.prompt_token_ids[0] == 1  # <|im_start|> opens the ChatML template
