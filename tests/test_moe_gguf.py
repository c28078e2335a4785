"""GGUF files of the mixture-of-experts families, in llama.cpp's layout (``gguf_moe_writer``): Mixtral (a
``llama`` file with experts), Qwen2-MoE (``qwen2moe``, a shared expert and a dense block), OLMoE
(``olmoe``, whose config tapllm builds from the metadata), Qwen3-MoE quantized (its F32 file is in
``test_family_moe``) and gpt-oss (``gpt-oss``: sinks, biases, a biased
router, the experts transposed and de-interleaved), F32 and quantized (Q8_0 everywhere but the routers;
gpt-oss's experts in MXFP4, as llama.cpp ships it). tapllm on the file equals transformers holding the
file's dequantized weights: greedy tokens, their logprobs and the logits at every position, float32.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_configs import moe_configs
from family_harness import check_logits
from gguf_moe_writer import write_moe_gguf
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from test_family_moe import _init  # the same weights' initialisation

CASES = [("mixtral", None), ("mixtral", "Q8_0"), ("qwen2_moe", None), ("qwen2_moe", "Q8_0"), ("qwen3_moe", "Q8_0"),
         ("olmoe", None), ("olmoe", "Q8_0"), ("gpt_oss", None), ("gpt_oss", "Q8_0"), ("gpt_oss", "MXFP4")]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, default_model_folder):
    """family -> the transformers model of its tiny random checkpoint."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-gguf")
    out = {}
    for name, cfg in moe_configs().items():
        if name in {c for c, _ in CASES}:
            folder = save_tiny_model(root / name, cfg, default_model_folder, init=_init)
            out[name] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return out


def _reference(family: str, model, state: dict[str, torch.Tensor]):
    """transformers holding ``state``, configured as the file can say: gpt-oss's SwiGLU limit is not in the
    files, so it is llama.cpp's (gpt-oss's) 7.0."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    if family == "gpt_oss":
        config.swiglu_limit = 7.0
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ref.load_state_dict(state)
    return ref


@pytest.mark.parametrize(("family", "qtype"), CASES, ids=[f"{f}-{q or 'F32'}" for f, q in CASES])
def test_moe_gguf_loads_and_matches_transformers(family, qtype, moe_models, tmp_path):
    model = moe_models[family]
    path, state = write_moe_gguf(tmp_path / f"tiny-{family}.gguf", family, model, qtype,
                                 experts_only=qtype == "MXFP4")
    if qtype is not None:
        assert any(not torch.equal(state[k], v) for k, v in model.state_dict().items())  # really rounded
    ref = _reference(family, model, state)
    llm = LLM(path, dtype="float32")
    assert llm.engine.model_config.architecture == model.config.architectures[0]
    prompts = random_prompts([5, 19], seed=47)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, [hf_greedy(ref, p, 6) for p in prompts], atol=1e-5)
    check_logits(llm, ref, prompts, 4)


def test_a_mixtral_file_with_one_tensor_per_expert_loads(moe_models, tmp_path):
    """Early Mixtral GGUF files hold each expert's projection apart (``blk.N.ffn_gate.E.weight``, ...)."""
    model = moe_models["mixtral"]
    path, state = write_moe_gguf(tmp_path / "tiny-mixtral-legacy.gguf", "mixtral", model, "Q8_0", legacy=True)
    import gguf

    assert "blk.0.ffn_gate.3.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    ref = _reference("mixtral", model, state)
    prompts = random_prompts([5, 19], seed=48)
    outs = LLM(path, dtype="float32").generate(
        prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert_matches_reference(outs, [hf_greedy(ref, p, 6) for p in prompts], atol=1e-5)


def test_an_unsupported_moe_architecture_is_named(tmp_path):
    """A GGUF architecture tapllm has no mapping for (here DeepSeek-2's) is refused naming it."""
    from gguf_writer import write_gguf

    path = write_gguf(tmp_path / "tiny-deepseek2.gguf", "deepseek2", {"block_count": 1, "expert_count": 4},
                      {"token_embd.weight": torch.zeros(8, 32)})
    with pytest.raises(ValueError, match="GGUF architecture 'deepseek2'.*not supported"):
        LLM(path, dtype="float32")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_gguf_blocks_run_as_stored_beside_dequantized_experts(family, moe_models, tmp_path):
    """``quantization="gguf"`` on an MoE file: attention (and Qwen2-MoE's shared expert and dense block)
    runs the file's Q8_0 blocks as stored (Mixtral's q/k row permutation undone on the blocks), routers and
    the stacked experts are dequantized; it equals the file loaded in float."""
    from tapllm.models.moe import Router, SparseMoE
    from tapllm.quant.linear import QuantLinear

    path, _ = write_moe_gguf(tmp_path / f"tiny-{family}.gguf", family, moe_models[family], "Q8_0")
    prompts = random_prompts([7, 18], seed=9)
    spec = HiddenStatesSpec(points=["final"], positions="all")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, hidden_states=spec)
    want = LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(path, dtype="float32", quantization="gguf")
    model = llm.engine.runner.model
    assert all(isinstance(layer.self_attn.qkv_proj, QuantLinear) for layer in model.layers)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(type(m.gate) is Router and m.experts.dtype == torch.float32 for m in moes)
    if family == "qwen2_moe":
        assert all(isinstance(m.shared_expert.gate_up_proj, QuantLinear) for m in moes)
        assert isinstance(model.layers[1].mlp.gate_up_proj, QuantLinear)  # the dense block
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(a.hidden_states["final"], b.hidden_states["final"], rtol=1e-4, atol=1e-4)
