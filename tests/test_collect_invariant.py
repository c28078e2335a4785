"""``tapllm collect`` runs batch_invariant by default: killed mid-run and resumed under other batching
limits, it writes every row bit for bit as an uninterrupted run did, in bfloat16 and float32.

The model's MLP is 1536 wide: at that depth oneDNN's bf16 GEMM gives a row other bits in a step of
other size, so without the invariant mode this test fails in both dtypes (checked with
``--no-batch-invariant`` throughout: 34 of 64 shard tensors differed in bfloat16, 40 of 64 in float32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tapllm.datasets
from conftest import TINY, random_prompts, save_tiny_model
from helpers import kill_once_written
from tapllm.cli import main

POINTS = "resid_pre,attn_out,mlp_out,resid_post,final"


def _input(path: Path) -> Path:
    prompts = random_prompts([20 + (i * 7) % 30 for i in range(64)], seed=9)
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    return path


def _args(model: Path, inp: Path, out: Path, dtype: str) -> list[str]:
    return ["collect", "--model", str(model), "--input", str(inp), "--out", str(out), "--dtype", dtype, "--quiet",
            "--layers", "all", "--points", POINTS, "--shard-tokens", "300", "--max-tokens", "4", "--positions", "all"]


@pytest.fixture(scope="module")
def wide_mlp_model(tmp_path_factory, default_model_folder) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, **{**TINY, "intermediate_size": 1536})
    return save_tiny_model(tmp_path_factory.mktemp("mlp") / "llama", cfg, default_model_folder)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_killed_and_resumed_run_equals_an_uninterrupted_one_bitwise(dtype, wide_mlp_model, tmp_path, capsys):
    model, inp = wide_mlp_model, _input(tmp_path / "in.jsonl")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(_args(model, inp, whole, dtype) + ["--max-num-seqs", "32"]) == 0
    assert json.loads((whole / "run.json").read_text())["batch_invariant"] is True

    # interrupted while batching 6 requests at a time in steps of 64 tokens ...
    manifest = cut / "progress-part000.jsonl"
    kill_once_written([sys.executable, "-m", "tapllm", *_args(model, inp, cut, dtype),
                       "--max-num-seqs", "6", "--max-num-batched-tokens", "64"], manifest, 2)
    done = len(manifest.read_text().splitlines())
    assert 2 <= done < len(json.loads((whole / "metadata.json").read_text())["shards"])
    # ... a resume without the invariant mode is refused: it would write other bits
    assert main(_args(model, inp, cut, dtype) + ["--no-batch-invariant"]) == 2
    assert "batch_invariant: True -> False" in capsys.readouterr().err
    # ... and resumed with yet other limits: chunks of 29 tokens, 5 requests at a time
    assert main(_args(model, inp, cut, dtype) + ["--max-num-seqs", "5", "--max-num-batched-tokens", "29"]) == 0

    a, b = tapllm.datasets.open(whole), tapllm.datasets.open(cut)
    b.verify()
    key = ("file", "requests", "rows", "bytes", "sha256")
    assert [[s[k] for k in key] for s in a.shards] == [[s[k] for k in key] for s in b.shards]
    for i in range(len(a.shards)):
        sa, sb = a.shard(i), b.shard(i)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
