"""Tensor (and pipeline) parallelism behind the server and collect: ``tapllm serve --tensor-parallel-size 2`` answers as
the same server at TP 1 (tokens, and states at residual and sharded points within 1e-5), ``collect``
at TP 2 writes the dataset TP 1 writes, and a rank killed mid-generation makes the server answer 503
naming it and exit by itself, leaving no process behind. Real server processes, real HTTP, real
worker processes.
"""

from __future__ import annotations

import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

import tapllm.datasets
from tapllm.client import decode_hidden_states

from server_util import KEY, Server, same_states
from test_collect import _assert_same_dataset, _collect, _records, _write_jsonl
from test_server_core import stream_events

openai = pytest.importorskip("openai")

SPEC = {"layers": "all", "points": ["resid_post", "attn_out", "z", "mlp_post"], "positions": "all"}


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def _spawned_children(proc: psutil.Process) -> list[psutil.Process]:
    """``proc``'s multiprocessing children (not the resource tracker)."""
    return [p for p in proc.children() if "spawn_main" in " ".join(p.cmdline())]


def _completions(server: Server) -> list:
    """Greedy completions with states (base64 and streamed) and with a steer at a residual and a sharded
    point: what one server answers, to hold against another."""
    client = server.client()
    v = torch.randn(64, generator=torch.Generator().manual_seed(3)).tolist()
    steering = [{"layers": [0, 2], "point": "resid_post", "vector": v, "scale": 3.0},
                {"layers": [1], "point": "mlp_post", "op": "scale", "scale": 0.0, "neurons": [3, 64, 100]}]
    common = dict(model="tiny_llama", max_tokens=8, temperature=0)
    out = []
    for prompt, extra in (("The capital of France is", {}), ("Once upon a time", {"steering": steering})):
        body = {"ignore_eos": True, "hidden_states": SPEC, **extra}
        r = client.completions.create(prompt=prompt, **common, extra_body=body)
        out.append((r.choices[0].text, decode_hidden_states(r.choices[0])))
        chunks = list(client.completions.create(prompt=prompt, stream=True, **common, extra_body=body))
        final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
        out.append(("".join(c.choices[0].text for c in chunks if c.choices), decode_hidden_states(final.choices[0])))
    return out


def test_server_at_tp2_answers_as_at_tp1(tiny_models):
    """TP 2, and two data-parallel replicas of a TP 2 group (four ranks, two engine cores), answer as TP 1."""
    answers = {}
    for name, flags in (("tp1", ("--tensor-parallel-size", "1")), ("tp2", ("--tensor-parallel-size", "2")),
                        ("dp2xtp2", ("--tensor-parallel-size", "2", "--data-parallel-size", "2")),
                        ("pp2", ("--pipeline-parallel-size", "2"))):
        server = Server(tiny_models["llama"], "--enable-hidden-states", "--enable-steering", "--api-key", KEY,
                        *flags)
        try:
            answers[name] = _completions(server)
        finally:
            server.stop()
        assert server.proc.returncode == 0, (name, server.proc.returncode)
    assert answers["tp1"][0][0] != answers["tp1"][2][0]  # the steer changed the text: the test can see a difference
    for name in ("tp2", "dp2xtp2", "pp2"):
        for (text1, hs1), (text2, hs2) in zip(answers["tp1"], answers[name], strict=True):
            assert text2 == text1, name
            assert list(hs1.points) == SPEC["points"] and hs1["z"].shape[-2:] == (4, 16)
            same_states(hs2, hs1)


def test_collect_at_tp2_writes_the_tp1_dataset(tiny_models, tmp_path):
    model = tiny_models["llama"]
    inp = _write_jsonl(tmp_path / "in.jsonl", _records(16, seed=4))
    args = ("--layers", "0,-1", "--points", "resid_post,mlp_out", "--positions", "all", "--max-tokens", "4",
            "--shard-tokens", "80")
    assert _collect(model, inp, tmp_path / "tp1", *args) == 0
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # batch_invariant (collect's default) cannot be combined with TP yet: the flag alone turns it off
    assert _collect(model, inp, tmp_path / "tp2", *args, "--tensor-parallel-size", "2") == 0
    one, two = tapllm.datasets.open(tmp_path / "tp1"), tapllm.datasets.open(tmp_path / "tp2")
    two.verify()
    assert one.metadata["num_shards"] > 1 and one.metadata["batch_invariant"] is True
    assert two.metadata["batch_invariant"] is False
    _assert_same_dataset(one, two)
    assert _collect(model, inp, tmp_path / "pp2", *args, "--pipeline-parallel-size", "2") == 0
    _assert_same_dataset(one, tapllm.datasets.open(tmp_path / "pp2"))
    left = [p.pid for p in _spawned_children(psutil.Process()) if p.pid not in before and _alive(p)]
    assert left == [], "collect left its tensor-parallel ranks running"

    # the same through the Python API, with the config's own engine
    from tapllm.collect.run import CollectConfig, collect
    from tapllm.config import EngineConfig

    cfg = CollectConfig(input=inp, out=tmp_path / "api", layers=[0, -1], points=["resid_post", "mlp_out"],
                        positions="all", max_tokens=4, shard_tokens=80,
                        engine=EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=2))
    collect(cfg, show_progress=False)
    assert [p for p in _spawned_children(psutil.Process()) if p.pid not in before and _alive(p)] == []
    _assert_same_dataset(one, tapllm.datasets.open(tmp_path / "api"))


MODES = {"core": (), "no-engine-process": ("--no-engine-process",), "two-api-servers": ("--api-server-count", "2")}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_rank_is_a_503_and_the_server_exits_leaving_no_process(tiny_models, mode):
    server = Server(tiny_models["llama"], "--tensor-parallel-size", "2", *MODES[mode],
                    env={"TAPLLM_TP_TIMEOUT_S": "10"})
    try:
        engine = psutil.Process(server.proc.pid)
        if mode != "no-engine-process":  # rank 0 is the engine-core process (among the API servers, if any)
            (engine,) = [p for p in _spawned_children(engine) if _spawned_children(p)]
        (rank1,) = _spawned_children(engine)
        tree = _tree(server.proc.pid)
        assert rank1 in tree and len(tree) >= 3

        first = threading.Event()
        events: list = []
        stream = threading.Thread(target=lambda: events.extend(stream_events(
            server, {"prompt": "Tell me a story", "max_tokens": 480, "ignore_eos": True}, first)))
        stream.start()
        assert first.wait(60)
        with ThreadPoolExecutor(1) as pool:  # a second request, in flight (running or waiting) at the kill
            other = pool.submit(server.post, "/v1/completions", {"prompt": "Hello there", "max_tokens": 400,
                                                                 "ignore_eos": True})
            time.sleep(0.5)
            killed_at = time.monotonic()
            rank1.kill()
            stream.join(30)
            assert not stream.is_alive(), "the stream hung after a rank died"
            status, body = other.result(timeout=30)
        assert time.monotonic() - killed_at < 30
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503, error
        assert "rank 1" in error["message"] and f"pid {rank1.pid}" in error["message"], error
        assert status == 503 and "rank 1" in body["error"]["message"], (status, body)

        # a request after the failure is refused (503) or finds the server gone: never served
        try:
            late = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=10)[0]
        except (urllib.error.URLError, ConnectionError):
            late = None
        assert late in (503, None), late

        assert server.proc.wait(timeout=30) == 1
        assert "rank 1" in server.output()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p.pid for p in tree if _alive(p)]
        assert left == [], f"processes of the server's tree left behind: {left}"
    finally:
        server.stop()


def test_an_idle_engine_finds_a_dead_rank(tiny_models):
    """What an idle server checks about once a second: a dead rank is found without a request."""
    from tapllm import LLM
    from tapllm.parallel import TensorParallelError

    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, dtype="float32", kv_cache_blocks=32)
    try:
        llm.engine.check_alive()
        (pid,) = llm.engine.runner.tp.worker_pids
        psutil.Process(pid).kill()
        llm.engine.runner.tp.procs[0].join(10)  # (reaped by its parent's own handle, as the engine would)
        with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {pid}\\) exited with code -9"):
            llm.engine.check_alive()
        with pytest.raises(TensorParallelError, match="broken earlier"):
            llm.engine.check_alive()
        assert not llm.engine.runner.tp.alive
    finally:
        llm.close()
