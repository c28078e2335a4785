"""``tapllm collect --router`` on a tiny mixture-of-experts model (Qwen2-MoE: 4 experts, top-2, block 1 dense):
each token row holds its chosen experts' ids (int16) and weights per block, equal to what ``LLM.encode``
captures as ``experts_chosen`` / ``routing_weights`` for the same prompt; -1 and NaN at the dense block."""

from __future__ import annotations

import json

import pytest
import torch

import tapllm.datasets
from conftest import random_prompts, save_tiny_model
from family_configs import moe_configs
from tapllm import LLM, HiddenStatesSpec
from tapllm.cli import main
from test_family_moe import _init


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_folder):
    return save_tiny_model(tmp_path_factory.mktemp("collect_moe") / "qwen2_moe", moe_configs()["qwen2_moe"],
                           default_model_folder, init=_init)


def _collect(model, inp, out, *extra: str) -> int:
    # MoE experts run one GEMM over every request's rows: not batch invariant, so a run says so
    return main(["collect", "--model", str(model), "--input", str(inp), "--out", str(out), "--dtype", "float32",
                 "--no-batch-invariant", "--quiet", *extra])


@pytest.mark.parametrize("fmt", ["safetensors", "arrow"])
def test_router_columns_equal_encode(fmt, model, tmp_path):
    prompts = random_prompts([7, 1, 15, 4], seed=81)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "acts"
    assert _collect(model, inp, out, "--router", "--points", "resid_post", "--shard-tokens", "10",
                    "--format", fmt) == 0
    ds = tapllm.datasets.open(out)
    ds.verify()
    assert ds.metadata["router"] == {"n_experts": 4, "top_k": 2} and ds.points == ["resid_post"]
    batch = ds[:]
    assert batch["expert_ids"].dtype == torch.int16 and batch["expert_ids"].shape == (27, 3, 2)
    assert batch["expert_weights"].dtype == torch.float32
    assert "experts_chosen" not in batch and "routing_weights" not in batch

    llm = LLM(model, dtype="float32")
    spec = HiddenStatesSpec(layers="all", points=["experts_chosen", "routing_weights"], positions="prompt")
    for i, ref in enumerate(llm.encode(prompts, spec, use_tqdm=False)):
        rows = batch["request_index"] == i
        ids, weights = batch["expert_ids"][rows].long(), batch["expert_weights"][rows]
        hs = ref.hidden_states
        for block in (0, 2):
            chosen = torch.zeros(len(prompts[i]), 4).scatter_(1, ids[:, block], 1.0)
            assert torch.equal(chosen, hs["experts_chosen"][:, block])
            torch.testing.assert_close(weights[:, block], hs["routing_weights"][:, block].gather(1, ids[:, block]))
            assert (weights[:, block, 0] >= weights[:, block, 1]).all()  # largest weight first
        assert (ids[:, 1] == -1).all() and weights[:, 1].isnan().all()  # the dense block


def test_router_needs_a_mixture_of_experts_model(tiny_models, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    assert main(["collect", "--model", str(tiny_models["llama"]), "--input", str(inp), "--out",
                 str(tmp_path / "acts"), "--router", "--quiet"]) != 0
    assert "--router: LlamaForCausalLM is not a mixture-of-experts model" in capsys.readouterr().err


def test_router_points_as_columns_point_to_router(model, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    assert _collect(model, inp, tmp_path / "acts", "--points", "experts_chosen") != 0
    assert "--router stores each token's chosen experts and weights" in capsys.readouterr().err


def test_the_routing_alone(model, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [5, 6, 7, 8]}) + "\n")
    assert _collect(model, inp, tmp_path / "acts", "--points", "none", "--router", "--layers", "0") == 0
    ds = tapllm.datasets.open(tmp_path / "acts")
    assert ds.points == [] and ds.layers == [0]
    assert set(ds[:]) == {"expert_ids", "expert_weights", "token_id", "request_index", "position"}
    assert ds[:]["expert_ids"].shape == (4, 1, 2)
