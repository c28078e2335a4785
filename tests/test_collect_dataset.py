"""``tapllm collect --dataset``: contexts through the model equal ``LLM.encode`` of the reference
contexts, store dtypes round-trip, the memory-mapped reader returns the rows of a full read
without loading whole shards, provenance, and kill -9 + resume with packing is bitwise."""

from __future__ import annotations

import json
import random
import resource
import sys
from pathlib import Path

import pytest
import torch

import tapllm.datasets
from helpers import assert_close, kill_once_written
from tapllm import LLM, HiddenStatesSpec
from tapllm.cli import main

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "seven", "quiet", "north"]


def _texts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def _parquet(path: Path, texts: list[str], column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path)
    return path


def _collect(model: Path, dataset: Path, out: Path, *extra: str, dtype: str = "float32") -> int:
    return main(["collect", "--model", str(model), "--dataset", str(dataset), "--out", str(out), "--dtype", dtype,
                 "--quiet", *extra])


def _full(ds) -> dict[str, torch.Tensor]:
    cols: dict[str, list[torch.Tensor]] = {}
    for batch in ds.iter_batches(1000):
        for k, v in batch.items():
            cols.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in cols.items()}


def _packed_reference(tok, texts: list[str], size: int) -> list[list[int]]:
    b = tok.bos_token_id
    stream = [t for x in texts for t in [b, *tok(x, add_special_tokens=False)["input_ids"]]]
    out, p = [], 0
    while p < len(stream):
        take = size if stream[p] == b else size - 1
        out.append(([] if stream[p] == b else [b]) + stream[p : p + take])
        p += take
    return out


def test_packed_contexts_equal_encode_without_special_rows(tiny_models, tmp_path):
    model = tiny_models["llama"]
    texts = _texts(40, seed=1) + ["<|im_end|> north " * 3]  # special tokens inside a document too
    data = _parquet(tmp_path / "d.parquet", texts, column="body")
    out = tmp_path / "acts"
    assert _collect(model, data, out, "--column", "body", "--context-size", "48", "--packing",
                    "--exclude-special-tokens", "--layers", "0,-1", "--points", "resid_post,attn_out",
                    "--shard-tokens", "200") == 0
    ds = tapllm.datasets.open(out)
    llm = LLM(model, dtype="float32")
    tok = llm.engine.tokenizer
    contexts = _packed_reference(tok, texts, 48)
    assert ds.metadata["num_requests"] == len(contexts) and ds.metadata["num_shards"] > 2
    spec = HiddenStatesSpec(layers=[0, -1], points=["resid_post", "attn_out"], positions="prompt")
    refs = llm.encode(contexts, spec, use_tqdm=False)
    special = set(tok.all_special_ids)
    full = _full(ds)
    for i, (ctx, ref) in enumerate(zip(contexts, refs, strict=True)):
        m = full["request_index"] == i
        keep = torch.tensor([t not in special for t in ctx])
        assert full["token_id"][m].tolist() == [t for t in ctx if t not in special]
        assert full["position"][m].tolist() == torch.arange(len(ctx))[keep].tolist()
        for point in ("resid_post", "attn_out"):
            assert_close(full[point][m], ref.hidden_states[point][keep])
    # provenance
    meta = ds.metadata
    assert meta["model"] == str(model.resolve()) and len(meta["weights_sha256"]) == 64
    assert meta["tapllm_version"] == tapllm.__version__
    assert meta["dataset"]["column"] == "body" and meta["dataset"]["split"] == "train"
    assert meta["dataset"]["fingerprint"] and meta["tokenizer"]["bos_token_id"] == tok.bos_token_id
    assert meta["context"] == {"size": 48, "packing": True, "truncate": False, "prepend_bos": True,
                               "bos_token_id": tok.bos_token_id, "max_rows": None, "max_tokens_total": None}
    assert meta["exclude_special_tokens"] is True and meta["store_dtype"] == "float32"


def test_a_document_longer_than_the_model_is_chunked_not_refused(tiny_models, tmp_path):
    import datasets

    model = tiny_models["qwen2"]
    long_doc = " ".join(WORDS[i % 10] for i in range(300))
    datasets.Dataset.from_list([{"text": "river stone"}, {"text": long_doc}]).save_to_disk(str(tmp_path / "ds"))
    out = tmp_path / "acts"
    # no --context-size: the model's context (here --max-model-len 64), one document at a time
    assert _collect(model, tmp_path / "ds", out, "--layers", "1", "--max-model-len", "64", "--no-prepend-bos") == 0
    llm = LLM(model, dtype="float32")
    tok = llm.engine.tokenizer
    ids = tok(long_doc, add_special_tokens=False)["input_ids"]
    contexts = [tok("river stone", add_special_tokens=False)["input_ids"]] + [ids[a : a + 64]
                                                                              for a in range(0, len(ids), 64)]
    full = _full(tapllm.datasets.open(out))
    assert full["token_id"].tolist() == [t for c in contexts for t in c]
    assert full["position"].tolist() == [p for c in contexts for p in range(len(c))]
    refs = llm.encode(contexts, HiddenStatesSpec(layers=[1], points=["resid_post"]), use_tqdm=False)
    assert_close(full["resid_post"], torch.cat([r.hidden_states["resid_post"] for r in refs]))


@pytest.mark.parametrize(("fmt", "dtype", "store"), [("safetensors", "float32", "bfloat16"),
                                                     ("arrow", "float32", "float16"),
                                                     ("arrow", "bfloat16", "auto")])
def test_store_dtype_round_trips(tiny_models, tmp_path, fmt, dtype, store):
    model = tiny_models["llama"]
    data = _parquet(tmp_path / "d.parquet", _texts(12, seed=2))
    args = ["--context-size", "32", "--packing", "--layers", "0,2", "--shard-tokens", "100", "--format", fmt]
    assert _collect(model, data, tmp_path / "ref", *args[:-2], dtype=dtype) == 0  # safetensors, compute dtype
    assert _collect(model, data, tmp_path / "st", *args, "--store-dtype", store, dtype=dtype) == 0
    ref, got = _full(tapllm.datasets.open(tmp_path / "ref")), _full(tapllm.datasets.open(tmp_path / "st"))
    want = torch.float32 if store == "auto" else getattr(torch, store)  # auto: Arrow has no bfloat16
    assert got["resid_post"].dtype == want
    assert torch.equal(got["resid_post"], ref["resid_post"].to(want))  # the cast of the same values, bitwise
    assert torch.equal(got["token_id"], ref["token_id"])
    if fmt == "arrow":
        import datasets

        hf = datasets.load_from_disk(str(tmp_path / "st")).with_format("torch")
        assert torch.equal(hf[7]["resid_post"].to(want), got["resid_post"][7])


@pytest.mark.parametrize("fmt", ["safetensors", "arrow"])
def test_random_access_reads_rows_not_shards(tiny_models, tmp_path, fmt):
    model = tiny_models["llama"]
    data = _parquet(tmp_path / "d.parquet", _texts(300, seed=3, lo=10, hi=60))
    out = tmp_path / "acts"
    assert _collect(model, data, out, "--context-size", "128", "--packing", "--layers", "all",
                    "--points", "resid_post,mlp_out", "--shard-tokens", "3000", "--format", fmt) == 0
    full = _full(tapllm.datasets.open(out))
    ds = tapllm.datasets.open(out)
    n = len(ds)
    assert ds.metadata["num_shards"] >= 3 and n == len(full["position"])
    g = torch.Generator().manual_seed(0)
    for size in (1, 7, 300):
        idx = torch.randint(-n, n, (size,), generator=g)
        got = ds[idx]
        for k, v in full.items():
            assert torch.equal(got[k], v[idx]), k
    row = ds[-3]
    assert all(torch.equal(row[k], full[k][n - 3]) for k in full)
    with pytest.raises(IndexError, match=f"row {n} out of range for {n} rows"):
        ds[[0, n]]

    # a standard DataLoader (batched reads through __getitems__), shuffled: every row once
    from torch.utils.data import DataLoader

    seen = torch.cat([b["request_index"] * 1000 + b["position"] for b in DataLoader(ds, batch_size=256, shuffle=True)])
    expect = full["request_index"] * 1000 + full["position"]
    assert torch.equal(seen.sort().values, expect.sort().values) and not torch.equal(seen, expect)
    # the iterable view with a shuffle buffer across shards: every row once, batched
    stream = ds.iterable(batch_size=100, shuffle_buffer=500, block_rows=64, seed=1)
    batches = list(DataLoader(stream, batch_size=None))
    keys = torch.cat([b["request_index"] * 1000 + b["position"] for b in batches])
    assert torch.equal(keys.sort().values, expect.sort().values)
    shard_of = {r: s for s, meta in enumerate(ds.shards) for r in range(*meta["requests"])}
    assert len({shard_of[int(r)] for r in batches[0]["request_index"]}) >= 2  # drawn across shards
    assert not torch.equal(keys, expect)

    # bytes read: a few rows of a fresh map touch a few pages, not a shard's worth
    shard_bytes = min(s["bytes"] for s in ds.metadata["shards"])
    fresh = tapllm.datasets.open(out)
    fresh[[0]]  # the code paths, warm
    fresh = tapllm.datasets.open(out)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fresh[torch.randint(0, n, (8,), generator=g)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(f"8 random rows: {faults} page faults; the smallest shard has {shard_bytes // 4096} pages")
    assert faults < shard_bytes / 4096 / 4, (faults, shard_bytes)


def test_kill_mid_run_then_resume_with_packing_is_bitwise(tiny_models, tmp_path):
    model = tiny_models["llama"]
    data = _parquet(tmp_path / "d.parquet", _texts(1500, seed=4, lo=5, hi=80))
    args = ["--context-size", "64", "--packing", "--layers", "all", "--points", "resid_post,mlp_out",
            "--shard-tokens", "400", "--max-num-seqs", "8", "--max-tokens-total", "40000"]
    whole = tmp_path / "whole"
    assert _collect(model, data, whole, *args) == 0
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "tapllm", "collect", "--model", str(model), "--dataset", str(data),
           "--out", str(cut), "--dtype", "float32", "--quiet", *args]
    manifest = cut / "progress-part000.jsonl"
    kill_once_written(cmd, manifest, 3)
    done = [json.loads(x) for x in manifest.read_text().splitlines()]
    total = json.loads((whole / "metadata.json").read_text())
    assert 3 <= len(done) < total["num_shards"] and all(e["cursor"] for e in done)
    assert _collect(model, data, cut, *args) == 0
    a, b = tapllm.datasets.open(whole), tapllm.datasets.open(cut)
    b.verify()
    key = ("file", "requests", "rows", "bytes", "sha256", "cursor")
    assert [[s[k] for k in key] for s in a.shards] == [[s[k] for k in key] for s in b.shards]
    assert a.metadata["num_rows"] == 40000


def test_dataset_refusals_come_before_the_model_loads(tiny_models, tmp_path, capsys, monkeypatch):
    from tapllm.engine.llm_engine import LLMEngine

    model = tiny_models["llama"]
    data = _parquet(tmp_path / "d.parquet", _texts(5, seed=5))

    def no_weights(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(LLMEngine, "__init__", no_weights)

    def err(*extra: str, dataset: Path = data) -> str:
        assert _collect(model, dataset, tmp_path / "o", *extra) == 2
        return capsys.readouterr().err

    assert "--context-size 1000 is longer than the model's context (512 positions)" in err("--context-size", "1000")
    assert "--packing and --truncate exclude each other" in err("--packing", "--truncate")
    assert "--column 'body' is not a column of --dataset" in err("--column", "body")
    assert "--max-rows must be >= 1, got 0" in err("--max-rows", "0")
    assert "Arrow has no bfloat16" in err("--format", "arrow", "--store-dtype", "bfloat16")
    (tmp_path / "d.xyz").write_text("x")
    assert "unknown file type '.xyz'" in err(dataset=tmp_path / "d.xyz")
    assert main(["collect", "--model", str(model), "--input", str(data), "--out", str(tmp_path / "o"),
                 "--context-size", "8", "--quiet"]) == 2
    assert "--context-size apply to --dataset" in capsys.readouterr().err
