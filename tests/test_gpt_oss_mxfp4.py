"""gpt-oss checkpoints with MXFP4 experts, as OpenAI publishes them (``experts.gate_up_proj_blocks`` /
``_scales``, ``down_proj_blocks`` / ``_scales``, ``quantization_config: {quant_method: mxfp4}``).

The tiny gpt-oss's experts are quantized here with an encoder of our own (the e2m1 code nearest each value
scaled by the block's power of two, the low nibble first), so the test does not lean on the code it
checks; tapllm loads the folder (dequantized once into its cache) and equals transformers loading the same
folder with ``Mxfp4Config(dequantize=True)``: greedy tokens, their logprobs and the logits, float32.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_configs import moe_configs
from family_harness import check_logits
from tapllm import LLM, SamplingParams

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., rows, K]`` -> blocks ``[..., rows, K/32, 16]`` (two e2m1 codes a byte, the even element in
    the low nibble) and scales ``[..., rows, K/32]`` (the block's power of two, biased by 127)."""
    *lead, k = w.shape
    x = w.reshape(*lead, k // 32, 32).float()
    amax = x.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)).clamp(-127, 127)
    y = x / torch.exp2(exp)[..., None]
    idx = (y.abs()[..., None] - FP4).abs().argmin(-1)
    code = (idx | (((y < 0) & (idx > 0)).long() << 3)).to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory, default_model_folder):
    """A tiny gpt-oss saved as OpenAI ships gpt-oss: its experts' weights as MXFP4 blocks and scales."""
    from safetensors.torch import load_file, save_file

    folder = save_tiny_model(tmp_path_factory.mktemp("mxfp4") / "gpt-oss", moe_configs()["gpt_oss"],
                             default_model_folder)
    state = load_file(folder / "model.safetensors")
    out = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]: blocks run along in
            out[name + "_blocks"], out[name + "_scales"] = encode_mxfp4(t.transpose(1, 2).contiguous())
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_mxfp4_checkpoint_loads_and_matches_transformers_dequantized(mxfp4_folder):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tapllm.loader import resolve_model

    ref = AutoModelForCausalLM.from_pretrained(mxfp4_folder, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.float32).eval()
    cached = resolve_model(mxfp4_folder)
    assert cached != mxfp4_folder and resolve_model(mxfp4_folder) == cached  # converted once
    assert "quantization_config" not in json.loads((cached / "config.json").read_text())
    llm = LLM(mxfp4_folder, dtype="float32")
    prompts = random_prompts([5, 19], seed=51)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, [hf_greedy(ref, p, 6) for p in prompts], atol=1e-5)
    check_logits(llm, ref, prompts, 3)


def test_the_encoder_round_trips_through_transformers_dequantization():
    """The test's encoder writes what transformers reads: values on the e2m1 grid come back exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2, 8, 2, 32), generator=g)
    codes[..., 0] = 7  # a 6 in every block: its scale is the one the encoder picks
    exps = torch.randint(-4, 3, (2, 8, 2, 1), generator=g).float()
    w = (torch.cat([FP4, -FP4])[codes] * torch.exp2(exps)).reshape(2, 8, 64)
    blocks, scales = encode_mxfp4(w)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), w.transpose(1, 2))


def test_other_prequantized_checkpoints_are_refused(tmp_path, tiny_models):
    """A ``quantization_config`` of another method is named, not loaded as if it were float weights."""
    import shutil

    folder = tmp_path / "gptq"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        LLM(folder, dtype="float32")


def test_mxfp4_of_another_architecture_is_refused(tmp_path, tiny_models):
    import shutil

    folder = tmp_path / "llama-mxfp4"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"MXFP4 checkpoints load for \['GptOssForCausalLM'\] only"):
        LLM(folder, dtype="float32")
