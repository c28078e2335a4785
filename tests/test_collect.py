"""``tapllm collect``: datasets equal encode/generate, resume after kill -9, Ray, bad input."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tapllm.datasets
from conftest import random_prompts
from helpers import assert_close
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.cli import main

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "seven", "quiet", "north"]


def _records(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(1, 25, (1,), generator=g))
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g)]
        if i % 5 == 3:
            out.append({"prompt_token_ids": random_prompts([k], seed=i)[0]})
        elif i % 5 == 4:
            out.append({"messages": [{"role": "user", "content": " ".join(words)}]})
        else:
            out.append({"text": " ".join(words)})
    return out


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prompts(llm: LLM, records: list[dict]) -> list:
    return [llm.apply_chat_template(r["messages"]) if "messages" in r else r.get("prompt_token_ids", r.get("text"))
            for r in records]


def _collect(model: Path, inp: Path, out: Path, *extra: str) -> int:
    return main(["collect", "--model", str(model), "--input", str(inp), "--out", str(out), "--dtype", "float32",
                 "--quiet", *extra])


def _rows_by_request(ds) -> dict[int, dict[str, torch.Tensor]]:
    cols: dict[str, list[torch.Tensor]] = {}
    for batch in ds.iter_batches(37):
        for k, v in batch.items():
            cols.setdefault(k, []).append(v)
    full = {k: torch.cat(v) for k, v in cols.items()}
    out = {}
    for idx in full["request_index"].unique().tolist():
        m = full["request_index"] == idx
        out[idx] = {k: v[m] for k, v in full.items()}
    return out


def _assert_same_dataset(a, b) -> None:
    assert len(a) == len(b) and a.metadata["num_requests"] == b.metadata["num_requests"]
    ra, rb = _rows_by_request(a), _rows_by_request(b)
    assert ra.keys() == rb.keys()
    for idx in ra:
        for k in ra[idx]:
            if k in ("token_id", "request_index", "position"):
                assert torch.equal(ra[idx][k], rb[idx][k])
            else:
                assert_close(ra[idx][k], rb[idx][k])


@pytest.mark.parametrize("fmt", ["safetensors", "arrow"])
def test_prompt_dataset_equals_encode(fmt, tiny_models, tmp_path):
    model = tiny_models["llama"]
    records = _records(30)
    inp = _write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "acts"
    assert _collect(model, inp, out, "--layers", "0,-1", "--points", "resid_post,attn_out",
                    "--shard-tokens", "60", "--format", fmt) == 0
    ds = tapllm.datasets.open(out)
    ds.verify()
    meta = ds.metadata
    assert meta["layers"] == [0, 2] and meta["num_requests"] == 30 and meta["num_shards"] > 2
    assert all(s["rows"] < 60 + 64 for s in meta["shards"])  # bounded: cut at the first request end past 60
    llm = LLM(model, dtype="float32")
    spec = HiddenStatesSpec(layers=[0, -1], points=["resid_post", "attn_out"], positions="prompt")
    refs = llm.encode(_prompts(llm, records), spec, use_tqdm=False)
    rows = _rows_by_request(ds)
    assert sorted(rows) == list(range(30))
    for i, ref in enumerate(refs):
        r = rows[i]
        assert r["position"].tolist() == list(range(len(ref.prompt_token_ids)))
        assert r["token_id"].tolist() == ref.prompt_token_ids
        for point in ("resid_post", "attn_out"):
            assert_close(r[point], ref.hidden_states[point])
    assert len(ds) == sum(len(r.prompt_token_ids) for r in refs)
    first = ds[0]
    assert first["resid_post"].shape == (2, 64) and int(first["request_index"]) == 0

    if fmt == "arrow":
        import datasets

        hf = datasets.load_from_disk(str(out))
        assert hf.num_rows == len(ds)
        hf.set_format("torch")
        assert_close(hf[5]["resid_post"], ds[5]["resid_post"])
        assert int(hf[5]["position"]) == int(ds[5]["position"])


def test_generated_dataset_equals_generate(tiny_models, tmp_path):
    model = tiny_models["qwen2"]
    records = _records(12, seed=3)
    inp = _write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "acts"
    assert _collect(model, inp, out, "--layers", "1", "--points", "resid_mid", "--positions", "all",
                    "--max-tokens", "5", "--shard-tokens", "40") == 0
    llm = LLM(model, dtype="float32")
    spec = HiddenStatesSpec(layers=[1], points=["resid_mid"], positions="all")
    refs = llm.generate(_prompts(llm, records), SamplingParams(max_tokens=5, temperature=0, hidden_states=spec),
                        use_tqdm=False)
    rows = _rows_by_request(tapllm.datasets.open(out))
    for i, ref in enumerate(refs):
        seq = ref.prompt_token_ids + ref.outputs[0].token_ids
        assert rows[i]["token_id"].tolist() == seq[: len(seq) - 1]
        assert_close(rows[i]["resid_mid"], ref.hidden_states["resid_mid"])


def _slow_records(n: int) -> list[dict]:
    return [{"prompt_token_ids": p} for p in random_prompts([40 + (i % 60) for i in range(n)], seed=5)]


def _assert_bitwise_equal(a_dir: Path, b_dir: Path) -> None:
    """Same shards (files, record ranges, sha256 of the bytes) and equal tensors."""
    a, b = tapllm.datasets.open(a_dir), tapllm.datasets.open(b_dir)
    a.verify()
    b.verify()
    key = ("file", "requests", "rows", "bytes", "sha256")
    assert [[s[k] for k in key] for s in a.shards] == [[s[k] for k in key] for s in b.shards]
    for i in range(len(a.shards)):
        sa, sb = a.shard(i), b.shard(i)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_kill_mid_run_then_resume_gives_a_bitwise_identical_dataset(tiny_models, tmp_path, capsys):
    """kill -9 mid-run, the same command again: every shard's bytes equal an uninterrupted run's.
    While the first run works, a second one on the same folder is refused at once (the lock)."""
    model = tiny_models["llama"]
    inp = _write_jsonl(tmp_path / "in.jsonl", _slow_records(600))
    args = ["--layers", "all", "--points", "resid_post,mlp_out", "--shard-tokens", "500", "--max-num-seqs", "8"]
    whole = tmp_path / "whole"
    assert _collect(model, inp, whole, *args) == 0

    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "tapllm", "collect", "--model", str(model), "--input", str(inp), "--out", str(cut),
           "--dtype", "float32", "--quiet", *args]
    # the same intra-op threads as this process, which computed the uninterrupted run
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    manifest = cut / "progress-part000.jsonl"
    deadline = time.time() + 120
    contended = False
    while time.time() < deadline and proc.poll() is None:
        lines = len(manifest.read_text().splitlines()) if manifest.exists() else 0
        if lines >= 1 and not contended:
            # a second run (this process) on the folder the first one is writing
            assert _collect(model, inp, cut, *args) == 2
            msg = capsys.readouterr().err
            assert f"--out {cut} is in use by another tapllm collect run (pid {proc.pid} on " in msg
            contended = True
        if lines >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    assert contended
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (cut / "metadata.json").exists()
    visible = [f.name for f in cut.iterdir() if not f.name.startswith(".")]
    done = len(manifest.read_text().splitlines())
    assert 3 <= done < len(json.loads((whole / "metadata.json").read_text())["shards"])
    with pytest.raises(FileNotFoundError, match="incomplete"):
        tapllm.datasets.open(cut)
    assert all(f.endswith((".safetensors", ".json", ".jsonl")) or f == "collect.lock" for f in visible)
    # what a kill in the middle of safetensors' own write leaves (its Rust tempfile), whether
    # or not this kill happened to land there
    (cut / ".tmpAb12Cd").write_bytes(b"partial")

    assert _collect(model, inp, cut, *args) == 0  # the same command again: the dead run's lock is gone
    assert not [f for f in cut.iterdir() if f.name.startswith(".")]  # no temporaries left
    _assert_bitwise_equal(whole, cut)


def test_ray_workers_produce_the_same_dataset(tiny_models, tmp_path):
    ray = pytest.importorskip("ray")
    from tapllm.collect.run import CollectConfig, collect
    from tapllm.config import EngineConfig

    model = tiny_models["llama"]
    inp = _write_jsonl(tmp_path / "in.jsonl", _records(40, seed=9))
    base = dict(input=inp, layers=[0, -1], points=["resid_post"], shard_tokens=80,
                engine=EngineConfig(model=str(model), dtype="float32", max_num_seqs=16))
    collect(CollectConfig(out=tmp_path / "single", **base), show_progress=False)
    slow = _write_jsonl(tmp_path / "slow.jsonl", _slow_records(800))
    slow_base = {**base, "input": slow, "layers": "all", "points": ["resid_post", "mlp_out"],
                 "engine": EngineConfig(model=str(model), dtype="float32", max_num_seqs=4), "shard_tokens": 300}
    try:
        collect(CollectConfig(out=tmp_path / "slow-ray", workers=2, **slow_base), ray_address="local",
                show_progress=False)
        meta = collect(CollectConfig(out=tmp_path / "ray", workers=2, **base), ray_address="local",
                       show_progress=False)
        assert {s["part"] for s in meta["shards"]} == {0, 1}
        _assert_same_dataset(tapllm.datasets.open(tmp_path / "single"), tapllm.datasets.open(tmp_path / "ray"))

        # a worker killed mid-run: its part is rerun from its last complete shard
        import psutil

        result: dict = {}
        cfg = CollectConfig(out=tmp_path / "ray-kill", workers=2, **slow_base)
        thread = threading.Thread(target=lambda: result.update(meta=collect(cfg, ray_address="local",
                                                                            show_progress=False)))
        thread.start()
        manifest = tmp_path / "ray-kill" / "progress-part001.jsonl"
        killed = None
        deadline = time.time() + 120
        while killed is None and time.time() < deadline and thread.is_alive():
            if manifest.exists() and manifest.read_text().count("\n") >= 1:
                for p in psutil.process_iter(["name", "cmdline"]):
                    if "CollectWorker" in " ".join(p.info["cmdline"] or []) + (p.info["name"] or ""):
                        p.kill()
                        killed = p.pid
                        break
            time.sleep(0.01)
        thread.join(timeout=300)
        assert killed is not None, "no worker could be killed mid-run"
        assert "meta" in result
        _assert_bitwise_equal(tmp_path / "slow-ray", tmp_path / "ray-kill")
    finally:
        ray.shutdown()


def test_bad_input_gets_clear_errors(tiny_models, tmp_path, capsys):
    model = tiny_models["llama"]
    good = _write_jsonl(tmp_path / "good.jsonl", _records(6))

    def err(*args: str) -> str:
        assert main(["collect", "--model", str(model), "--dtype", "float32", "--quiet", *args]) == 2
        return capsys.readouterr().err

    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"body": "no usable field"}])
    assert "bad.jsonl:2: needs a 'text', 'prompt', 'messages' or 'prompt_token_ids' field" in err(
        "--input", str(bad), "--out", str(tmp_path / "o1"))
    (tmp_path / "empty.jsonl").write_text("")
    assert "holds no records" in err("--input", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o2"))
    assert "no such file" in err("--input", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o3"))
    assert "layer 9 is out of range for a 3-block model" in err(
        "--input", str(good), "--out", str(tmp_path / "o4"), "--layers", "0,9")
    assert "unknown point 'resid'" in err("--input", str(good), "--out", str(tmp_path / "o5"), "--points", "resid")

    out = tmp_path / "acts"
    assert _collect(model, good, out, "--layers", "0") == 0
    msg = err("--input", str(good), "--out", str(out), "--layers", "1")
    assert "holds a different run's dataset (layers: [0] -> [1])" in msg and "--overwrite" in msg
    assert _collect(model, good, out, "--layers", "1", "--overwrite") == 0
    assert tapllm.datasets.open(out).layers == [1]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert "not a tapllm dataset" in err("--input", str(good), "--out", str(tmp_path / "other"))
    assert "Arrow has no bfloat16" in main_err(model, good, tmp_path / "o6", capsys)


def main_err(model: Path, inp: Path, out: Path, capsys) -> str:
    assert main(["collect", "--model", str(model), "--dtype", "bfloat16", "--quiet", "--input", str(inp),
                 "--out", str(out), "--format", "arrow", "--store-dtype", "bfloat16"]) == 2
    return capsys.readouterr().err


def test_full_disk_leaves_no_corrupt_shard(tiny_models, tmp_path):
    """A file-size limit makes the shard write fail like a full disk: clear error, nothing half-written."""
    model = tiny_models["llama"]
    inp = _write_jsonl(tmp_path / "in.jsonl", _slow_records(60))
    out = tmp_path / "acts"

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    cmd = [sys.executable, "-m", "tapllm", "collect", "--model", str(model), "--input", str(inp), "--out", str(out),
           "--dtype", "float32", "--quiet", "--layers", "all", "--points", "resid_post", "--shard-tokens", "1000"]
    done = subprocess.run(cmd, preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"no space left writing {out}/part000-" in done.stderr  # the file's path
    assert not [f for f in out.iterdir() if f.name.startswith(".")]
    listed = [json.loads(x)["file"] for x in (out / "progress-part000.jsonl").read_text().splitlines()]
    shards = sorted(f.name for f in out.glob("part000-*"))
    assert shards == listed  # every shard on disk is complete and recorded
    # with room again, the same command completes the dataset
    assert _collect(model, inp, out, "--layers", "all", "--points", "resid_post", "--shard-tokens", "1000") == 0
    assert tapllm.datasets.open(out).metadata["num_requests"] == 60
