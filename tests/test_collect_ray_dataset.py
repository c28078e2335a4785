"""``tapllm collect --dataset --ray-address`` on a local 2-node Ray cluster (one CPU per node):
every worker reads its own part of the dataset; the rows equal a one-process run; a worker
killed mid-run and a driver killed mid-run both resume exactly."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tapllm.datasets
from conftest import _tiny_configs, save_tiny_model

ray = pytest.importorskip("ray")
datasets = pytest.importorskip("datasets")

from tapllm.collect.distributed import NAMESPACE, actor_name  # noqa: E402
from tapllm.collect.hf_input import DatasetSpec, open_dataset  # noqa: E402
from tapllm.collect.dataset_parts import part_of  # noqa: E402
from tapllm.collect.run import CollectConfig, collect  # noqa: E402
from tapllm.config import EngineConfig  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "seven", "quiet", "north"]
SETTINGS = dict(layers="all", points=["resid_post"], context_size=32, shard_tokens=64, prepend_bos=True)


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_folder):
    """A tiny model, a 300-record ``save_to_disk`` dataset, and a 2-node Ray cluster this process drives."""
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("raycollect")
    model = save_tiny_model(root / "llama", _tiny_configs()["llama"], default_model_folder)
    data = root / "ds"
    datasets.Dataset.from_dict({"text": _texts(300, seed=3)}).save_to_disk(str(data))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield {"model": model, "data": data, "cluster": cluster, "root": root}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _cfg(s: dict, out: Path, data: Path | None = None, **extra) -> CollectConfig:
    engine = EngineConfig(model=str(s["model"]), dtype="float32", max_num_seqs=8, batch_invariant=True)  # collect's default
    return CollectConfig(out=out, dataset=DatasetSpec(str(data or s["data"])), engine=engine, **{**SETTINGS, **extra})


def _one_process(cfg: CollectConfig) -> dict:
    """A run in this process with one intra-op thread, as each Ray worker computes (1 CPU per node)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return collect(cfg, show_progress=False)
    finally:
        torch.set_num_threads(threads)


def _rows(path: Path) -> dict[str, torch.Tensor]:
    cols: dict[str, list[torch.Tensor]] = {}
    for batch in tapllm.datasets.open(path).iter_batches(4096):
        for k, v in batch.items():
            cols.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in cols.items()}


KEY = ("requests", "rows", "bytes", "sha256", "cursor")


def _shards(path: Path) -> list[list]:
    ds = tapllm.datasets.open(path)
    ds.verify()
    return [[s["part"], *[s[k] for k in KEY]] for s in ds.shards]


def _manifest_lines(out: Path, part: int) -> int:
    f = out / f"progress-part{part:03d}.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_parts_of_a_stream_and_of_a_saved_dataset_cover_the_input_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [str(i) for i in range(11)]
    pq.write_table(pa.table({"text": texts[:6]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": texts[6:]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"text": texts}), tmp_path / "all.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    for name, parts, max_rows, want in [
        ("ds", 2, None, [texts[:6], texts[6:]]),  # contiguous blocks
        ("ds", 3, 7, [texts[0:3], texts[3:5], texts[5:7]]),  # --max-rows before the split
        (str(tmp_path / "[ab].parquet"), 2, None, [texts[:6], texts[6:]]),  # whole files
        ("all.parquet", 3, None, [texts[0::3], texts[1::3], texts[2::3]]),  # every 3rd record
        ("all.parquet", 2, 7, [texts[0:7:2], texts[1:7:2]]),
    ]:
        ds = open_dataset(DatasetSpec(name if name.startswith("/") else str(tmp_path / name)))
        got = [[r["text"] for r in part_of(ds, k, parts, max_rows)] for k in range(parts)]
        assert got == want, name
        # a resumed part skips within its own records (datasets 5.2's split_dataset_by_node would not)
        assert [[r["text"] for r in part_of(ds, k, parts, max_rows).skip(1)] for k in range(parts)] == \
            [w[1:] for w in want], name
    with pytest.raises(ValueError, match="part 2 of 2"):
        part_of(ds, 2, 2)
    cfg = CollectConfig(out=tmp_path / "o", dataset=DatasetSpec("ds"), workers=2, max_tokens_total=100)
    with pytest.raises(ValueError, match="--max-tokens-total is a budget over one stream"):
        cfg.validate()


def test_ray_dataset_equals_one_process_and_a_killed_driver_resumes(setup, tmp_path, caplog):
    """Without --packing each context is one document's: the 2 parts (contiguous halves of the
    saved dataset) in order give the one-process rows in order; only ``request_index`` counts
    contexts within each part. Then the same command killed mid-run (its driver, kill -9) and
    run again gives the uninterrupted run's shards byte for byte."""
    s = setup
    address = s["cluster"].address
    single = _one_process(_cfg(s, tmp_path / "single"))
    caplog.set_level(logging.INFO, logger="tapllm")
    meta = collect(_cfg(s, tmp_path / "ray", workers=2), ray_address=address, show_progress=False)
    rates = [r.getMessage() for r in caplog.records if r.getMessage().startswith("part ")]
    print("per worker:", rates, f"(uptime: {os.getloadavg()})")
    assert {sh["part"] for sh in meta["shards"]} == {0, 1}
    assert meta["num_rows"] == single["num_rows"] and meta["num_requests"] == single["num_requests"]
    a, b = _rows(tmp_path / "single"), _rows(tmp_path / "ray")
    for k in ("token_id", "position"):
        assert torch.equal(a[k], b[k])
    assert float((a["resid_post"] - b["resid_post"]).abs().max()) <= 1e-5 * float(a["resid_post"].abs().max())
    rows0 = sum(sh["rows"] for sh in meta["shards"] if sh["part"] == 0)
    n0 = sum(sh["requests"][1] - sh["requests"][0] for sh in meta["shards"] if sh["part"] == 0)
    assert torch.equal(a["request_index"][:rows0], b["request_index"][:rows0])
    assert torch.equal(a["request_index"][rows0:], b["request_index"][rows0:] + n0)  # counted per part

    # the driver killed mid-run, then the same command again
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "tapllm", "collect", "--model", str(s["model"]), "--dataset", str(s["data"]),
           "--out", str(cut), "--dtype", "float32", "--quiet", "--layers", "all", "--points", "resid_post",
           "--context-size", "32", "--shard-tokens", "64", "--prepend-bos", "--max-num-seqs", "8",
           "--ray-address", address, "--workers", "2"]
    log = tmp_path / "driver.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and _manifest_lines(cut, 0) + _manifest_lines(cut, 1) < 2:
        time.sleep(0.01)
    assert proc.poll() is None, f"the driver ended before it could be killed: {log.read_text()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = _manifest_lines(cut, 0) + _manifest_lines(cut, 1)
    assert not (cut / "metadata.json").exists() and 2 <= done < len(meta["shards"])
    collect(_cfg(s, cut, workers=2), ray_address=address, show_progress=False)
    assert _shards(cut) == _shards(tmp_path / "ray")


def test_packed_parts_and_a_killed_worker_resume_exactly(setup, tmp_path):
    """With --packing each part packs its own records: the Ray run's part k equals a one-process
    run over part k's records, shard for shard and byte for byte, although the worker of part 0
    was killed (``ray.kill``) mid-run and its replacement resumed from the part's manifest."""
    s = setup
    ds = open_dataset(DatasetSpec(str(s["data"])))
    reference = []
    for k in range(2):
        part_of(ds, k, 2).save_to_disk(str(tmp_path / f"part{k}"))
        _one_process(_cfg(s, tmp_path / f"one{k}", tmp_path / f"part{k}", packing=True))
        reference += [[k, *row[1:]] for row in _shards(tmp_path / f"one{k}")]

    out = tmp_path / "ray-kill"
    cfg = _cfg(s, out, workers=2, packing=True)
    result: dict = {}

    def run() -> None:
        try:
            result["meta"] = collect(cfg, ray_address=s["cluster"].address, show_progress=False)
        except BaseException as exc:  # reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    killed_at = None
    deadline = time.time() + 180
    while killed_at is None and time.time() < deadline and thread.is_alive():
        lines = _manifest_lines(out, 0)
        if lines >= 1:
            ray.kill(ray.get_actor(actor_name(out.resolve(), 0, attempt=0), namespace=NAMESPACE))
            killed_at = lines
        time.sleep(0.005)
    thread.join(timeout=300)
    assert "error" not in result, result.get("error")
    assert killed_at is not None, "no worker could be killed mid-run"
    shards = _shards(out)
    assert killed_at < len([r for r in shards if r[0] == 0]), "the worker finished before the kill"
    assert shards == reference
    assert json.loads((out / "run.json").read_text())["context"]["packing"] is True
