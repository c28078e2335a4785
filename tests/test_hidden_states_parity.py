"""Captured states equal Hugging Face transformers' at every point, block and position (fp32)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.hidden_states import HIDDEN_POINTS as POINTS

ARCHS = ["llama", "llama3-rope-tied", "mistral", "qwen2", "qwen3"]
NEW = 6


def hf_states(model, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Per-point states [positions, layers, hidden] of one sequence from a transformers model.

    Block inputs and the final norm come from ``output_hidden_states``; the sublayer outputs
    from forward hooks on each block's attention and MLP modules, and ``resid_mid`` from the
    input of the post-attention norm.
    """
    blocks = model.model.layers
    got: dict[str, list[torch.Tensor]] = {"attn_out": [], "mlp_out": [], "resid_mid": []}
    handles = []
    for layer in blocks:
        handles.append(layer.self_attn.register_forward_hook(lambda m, i, o: got["attn_out"].append(o[0][0])))
        handles.append(layer.mlp.register_forward_hook(lambda m, i, o: got["mlp_out"].append(o[0])))
        handles.append(
            layer.post_attention_layernorm.register_forward_pre_hook(lambda m, i: got["resid_mid"].append(i[0][0]))
        )
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    hs = [h[0] for h in out.hidden_states]  # L + 1 tensors [T, H]
    n = len(blocks)
    resid_post = [got["resid_mid"][i] + got["mlp_out"][i] for i in range(n)]
    return {
        "embed": hs[0][:, None],
        "resid_pre": torch.stack(hs[:n], 1),
        "attn_out": torch.stack(got["attn_out"], 1),
        "resid_mid": torch.stack(got["resid_mid"], 1),
        "mlp_out": torch.stack(got["mlp_out"], 1),
        "resid_post": torch.stack(resid_post, 1),
        "final": hs[n][:, None],
    }


def assert_close_states(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Within 1e-4 of the state's scale (largest magnitude, at least 1), per layer."""
    assert got.shape == ref.shape, what
    for li in range(ref.shape[1]):
        scale = max(1.0, float(ref[:, li].abs().max()))
        err = float((got[:, li] - ref[:, li]).abs().max())
        assert err <= 1e-4 * scale, f"{what} layer {li}: max error {err:.3g} at scale {scale:.3g}"


def _check_against_hf(llm: LLM, model, prompts: list[list[int]], new: int) -> None:
    spec = HiddenStatesSpec(layers="all", points=list(POINTS), positions="all")
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                                                hidden_states=spec), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.outputs[0].token_ids
        hs = out.hidden_states
        run = len(seq) - 1  # the last sampled token is never run
        assert hs.positions.tolist() == list(range(run))
        ref = hf_states(model, seq[:run])
        for point in POINTS:
            assert hs[point].is_contiguous() and hs[point].device.type == "cpu"
            assert_close_states(hs[point], ref[point], f"{point} (prompt {len(prompt)} tokens)")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_point_matches_transformers(arch, tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    llm = LLM(tiny_models[arch], dtype="float32")
    prompts = random_prompts([1, 5, 23, 40], seed=3)
    _check_against_hf(llm, model, prompts, NEW)


@pytest.mark.slow
def test_default_model_matches_transformers_generate(default_model_folder):
    """The default model against ``generate(output_hidden_states=True)`` itself, step by step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32).eval()
    llm = LLM(dtype="float32")
    prompt = llm.tokenizer.encode("The three primary colors are")
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, output_hidden_states=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
    steps = ref.hidden_states  # step 0: prompt positions; step k: position p + k - 1
    ref_hs = [torch.cat([s[i][0] for s in steps], 0) for i in range(len(steps[0]))]
    spec = HiddenStatesSpec(points=["embed", "resid_pre", "final"], positions="all")
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0, hidden_states=spec), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.sequences[0, len(prompt):].tolist()
    hs = out.hidden_states
    n = model.config.num_hidden_layers
    assert hs.positions.tolist() == list(range(len(prompt) + NEW - 1))
    assert_close_states(hs["embed"], ref_hs[0][:, None], "embed")
    assert_close_states(hs["resid_pre"], torch.stack(ref_hs[:n], 1), "resid_pre")
    assert_close_states(hs["final"], ref_hs[n][:, None], "final")

    # and every point through hooks, over a batch with prompt and generated positions
    _check_against_hf(llm, model, random_prompts([7, 33], seed=5), 4)
