"""Bad input gets a clear error naming the field or file, before anything is scheduled."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import random_prompts
from tapllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(top_p=1e-300), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(stop=["a\ud800"]), "stop"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=-2), "logprobs"),  # -1 is vLLM's whole vocabulary
    ],
)
def test_sampling_params_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_before_anything_runs(llm):
    good = random_prompts([5])[0]
    before = llm.engine.num_generated_tokens
    cases = [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 49152], r"49152.*vocabulary \[0, 49152\)"),
        ([-3], "vocabulary"),
        ([1, 2.5], "must be integers"),
        (list(range(100, 100 + 512)), r"512 tokens.*max_model_len\) is 512"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate([good, bad], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        llm.generate([good, []], use_tqdm=False)
    assert llm.engine.num_generated_tokens == before
    assert not llm.engine.has_unfinished_requests()
    # The engine still serves afterwards.
    assert len(llm.generate([good], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_prompt_larger_than_kv_cache(tiny_models):
    small = LLM(tiny_models["llama"], dtype="float32", block_size=4, kv_cache_blocks=3)
    with pytest.raises(ValueError, match="kv_cache_blocks"):
        small.generate([list(range(100, 120))], use_tqdm=False)


def test_context_is_capped_to_the_kv_cache(tiny_models):
    """A cache smaller than the context caps max_model_len, so no admitted request can outgrow it."""
    small = LLM(tiny_models["llama"], dtype="float32", block_size=4, kv_cache_blocks=3)
    assert small.engine.model_config.max_model_len == 12
    outs = small.generate([list(range(100, 108))], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12 - 8 and outs[0].error is None
    with pytest.raises(ValueError, match=r"max_model_len\) is 12 \(capped to what the KV cache holds"):
        small.generate([list(range(100, 112))], use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_blocks=0), "kv_cache_blocks"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_engine_settings(tiny_models, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_models["llama"], **kwargs)


def test_missing_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        LLM(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(tmp_path)


def test_unknown_architecture(tiny_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"MambaForCausalLM.*not supported; supported: .*GPT2LMHeadModel.*Gemma2ForCausalLM"):
        LLM(folder)


def test_corrupt_checkpoint_files(tiny_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt checkpoint file .*model.safetensors"):
        LLM(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt config file"):
        LLM(folder)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="bad.gguf"):
        LLM(bad)
    with pytest.raises(ValueError, match=".gguf"):
        LLM(weights)


def test_missing_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors.*gate_up_proj"):
        LLM(folder)


def test_python_api_argument_errors_name_the_argument(llm):
    good = random_prompts([5])[0]
    with pytest.raises(TypeError, match="bytes"):
        llm.generate([b"bytes"], use_tqdm=False)
    with pytest.raises(TypeError, match="bytes"):
        llm.generate(b"bytes", use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate([good, 3.5], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate([good], "greedy", use_tqdm=False)
    with pytest.raises(ValueError, match="unknown key"):
        llm.generate([good], {"max_tokenz": 2}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"messages\[0\].content"):
        llm.chat([{"role": "user", "content": 7}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\].content is required"):
        llm.chat([{"role": "user"}], use_tqdm=False)
    with pytest.raises(TypeError, match=r"messages\[1\].role"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": None, "content": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match="not valid Unicode.*index 1"):
        llm.generate(["a\ud800b"], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # a dict works as SamplingParams, like every other option object
    out = llm.generate([good], {"max_tokens": 2, "temperature": 0, "ignore_eos": True}, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_unusable_device_is_a_clear_error(tiny_models):
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            LLM(tiny_models["llama"], device="cuda")
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_models["llama"], device="tpu")
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_models["llama"], device="no such device")
