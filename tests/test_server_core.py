"""The engine core in its own process (the default of ``tapllm serve``): real server, real core process.

Checked here: the core runs in a child process and answers exactly as the in-process engine
(``--no-engine-process``) does, tokens and states (states through shared memory: the tests
lower ``TAPLLM_SHM_MIN_BYTES``, and no segment is left behind); a core that dies is a 503 for
what was in flight and an exit with status 1, not a hang; SIGTERM lets the request in flight
finish, then stops the core. Client disconnects and shutdown under load are in
test_server.py and test_server_hardening.py, which run in this mode too.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from tapllm.client import decode_hidden_states
from tapllm.server import ipc

from server_util import Server

SHM_ENV = {"TAPLLM_SHM_MIN_BYTES": "1024"}  # every state tensor over 1 KiB crosses through shared memory
SPEC = {"layers": "all", "points": ["resid_post", "mlp_out"], "positions": "all"}


def core_pid(server: Server) -> int:
    """The engine-core child of ``server`` (not multiprocessing's resource tracker)."""
    kids = [p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(kids) == 1, [p.cmdline() for p in psutil.Process(server.proc.pid).children()]
    return kids[0].pid


def segments(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{ipc.SHM_PREFIX}{pid}-")]


def stream_events(server: Server, body: dict, first: threading.Event | None = None) -> list:
    """The SSE events of a streaming completion (JSON objects, and the final "[DONE]")."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
    resp = conn.getresponse()
    assert resp.status == 200
    events: list = []
    for line in resp:
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
            if first is not None:
                first.set()
    conn.close()
    return events


@pytest.fixture(scope="module")
def core_server(tiny_models):
    s = Server(tiny_models["llama"], "--enable-hidden-states", env=SHM_ENV)
    yield s
    s.stop()


def test_core_process_answers_as_the_in_process_engine(tiny_models, core_server):
    pid = core_pid(core_server)
    assert psutil.Process(pid).is_running()
    inproc = Server(tiny_models["llama"], "--enable-hidden-states", "--no-engine-process")
    try:
        assert not [p for p in psutil.Process(inproc.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        bodies = [("/v1/completions", {"prompt": "the cat sat on", "max_tokens": 12, "ignore_eos": True,
                                       "logprobs": 2, "hidden_states": SPEC}),
                  ("/v1/completions", {"prompt": "one two three", "max_tokens": 6, "n": 2, "temperature": 0.8,
                                       "seed": 7}),
                  ("/v1/hidden_states", {"input": "a longer prompt of several words " * 6, "hidden_states": SPEC})]
        for path, body in bodies:
            (c1, r1), (c2, r2) = core_server.post(path, body), inproc.post(path, body)
            assert c1 == c2 == 200, (r1, r2)
            items1 = r1.get("choices") or r1.get("data")
            items2 = r2.get("choices") or r2.get("data")
            for a, b in zip(items1, items2, strict=True):
                assert a.get("text") == b.get("text") and a.get("logprobs") == b.get("logprobs")
                hs1, hs2 = decode_hidden_states(a), decode_hidden_states(b)
                assert (hs1 is None) == (hs2 is None)
                if hs1 is not None:
                    assert torch.equal(torch.as_tensor(hs1.positions), torch.as_tensor(hs2.positions))
                    assert hs1["resid_post"].numel() * 4 > 1024
                    for point in SPEC["points"]:
                        assert torch.equal(hs1[point], hs2[point])
    finally:
        inproc.stop()
    time.sleep(0.5)
    assert segments(pid) == []  # every segment was read and unlinked by the API server


def test_dead_core_is_a_503_and_an_exit(tiny_models):
    server = Server(tiny_models["llama"])
    try:
        pid = core_pid(server)
        first = threading.Event()
        out: list = []
        t = threading.Thread(target=lambda: out.extend(stream_events(
            server, {"prompt": "Tell me a story", "max_tokens": 480, "ignore_eos": True}, first)))
        t.start()
        assert first.wait(60)
        os.kill(pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream hung after the core died"
        assert out[-1] == "[DONE]" and out[-2]["error"]["type"] == "ServiceUnavailableError", out[-3:]
        assert "engine core process" in out[-2]["error"]["message"]
        assert server.proc.wait(timeout=20) == 1
        assert "engine core process" in server.output()
    finally:
        server.stop()


def test_sigterm_drains_then_stops_the_core(core_server):
    pid = core_pid(core_server)
    first = threading.Event()
    out: list = []
    t = threading.Thread(target=lambda: out.extend(stream_events(
        core_server, {"prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True, "hidden_states": SPEC},
        first)))
    t.start()
    assert first.wait(60)
    core_server.proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert out[-1] == "[DONE]" and out[-2]["choices"][0]["finish_reason"] == "length", out[-3:]
    assert decode_hidden_states(out[-2]["choices"][0]) is not None
    assert core_server.proc.wait(timeout=30) == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert segments(pid) == []


def test_two_api_servers_share_the_port_and_stop_together(tiny_models):
    server = Server(tiny_models["llama"], "--api-server-count", "2")
    try:
        kids = [p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(kids) == 3  # the core and two API servers
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            server.post("/v1/completions", {"prompt": "hello there", "max_tokens": 4})[0])) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * 8
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, server.output()[-2000:]
        assert time.monotonic() - t0 < 15
        gone = [not psutil.pid_exists(p.pid) or p.status() == psutil.STATUS_ZOMBIE for p in kids]
        assert all(gone), server.output()[-2000:]
    finally:
        server.stop()


def test_data_parallel_routes_a_prefix_to_the_replica_holding_it(tiny_models):
    server = Server(tiny_models["llama"], "--data-parallel-size", "2")  # KV blocks of 16 tokens
    try:
        kids = [p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(kids) == 2  # two engine cores
        prefix = list(range(100, 100 + 96))  # six full blocks

        def send(tokens: list[int]) -> None:
            assert server.post("/v1/completions", {"prompt": tokens, "max_tokens": 2})[0] == 200

        def per_replica(name: str) -> list[float]:
            _, text = server.get("/metrics")
            rows = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
            return [float(ln.rsplit(" ", 1)[1]) for ln in sorted(rows)]

        send(prefix + [7])
        first = per_replica("tapllm_dp_requests_routed_total").index(1.0)
        send(list(range(300, 396)))  # another prefix: the other, idle replica
        assert per_replica("tapllm_dp_requests_routed_total") == [1.0, 1.0]
        for tail in ([8], [9, 10], [11]):
            hits = server.metric("tapllm_prefix_cache_hits_total")
            send(prefix + tail)
            deadline = time.time() + 10  # the core's figures arrive with its next message
            while server.metric("tapllm_prefix_cache_hits_total") < hits + 96 and time.time() < deadline:
                time.sleep(0.1)
            assert server.metric("tapllm_prefix_cache_hits_total") >= hits + 96  # the whole prefix was cached there
        routed, affinity = per_replica("tapllm_dp_requests_routed_total"), per_replica("tapllm_dp_affinity_routed_total")
        assert routed[first] == 4 and affinity[first] == 3 and routed[1 - first] == 1
        hit_rate = server.metric("tapllm_prefix_cache_hit_rate")
        print(f"data-parallel 2 replicas, prefix-hit rate of the run: {hit_rate:.2f}")
        assert hit_rate > 0.5
    finally:
        server.stop()


def test_router_prefers_the_prefix_holder_unless_it_is_much_busier():
    from tapllm.server.router import PrefixRouter

    router = PrefixRouter(2, block_size=4, slack=2)
    a, b = list(range(12)), list(range(50, 62))
    ra = router.choose(a + [1])
    rb = router.choose(b)
    assert ra != rb  # idle: the least used
    assert router.choose(a + [2, 3]) == ra  # the holder of a's blocks, though busier by one
    assert router.choose(a[:3]) in (0, 1)  # no full block: by load alone
    before = []  # (ra's load, rb's load) when each pick was made
    while True:  # to ra until it is much busier, then to rb
        before.append((router.replicas[ra].in_flight, router.replicas[rb].in_flight))
        if router.choose(a + [9]) == rb:
            break
    ra_load, rb_load = before[-1]
    assert len(before) > 1 and ra_load > rb_load + 2 and ra_load > 2 * rb_load  # "much busier" at slack=2
    assert before[-2][0] <= before[-2][1] + 2 or before[-2][0] <= 2 * before[-2][1]


def test_router_of_one_replica_keeps_no_prefix_table():
    from tapllm.server.router import PrefixRouter

    router = PrefixRouter(1, block_size=4)
    assert [router.choose(list(range(i, i + 40))) for i in range(5)] == [0] * 5
    only = router.replicas[0]
    assert (only.in_flight, only.routed, only.affinity_routed, len(only.blocks)) == (5, 5, 0, 0)
    router.done(0)
    assert only.in_flight == 4


# Imported first in every process of the server (PYTHONPATH): counts InputProcessor.prepare calls,
# one line "pid request_id" each, in the file named by $TAPLLM_PREPARE_LOG.
_COUNTING_SITECUSTOMIZE = '''
import importlib.abc, importlib.machinery, os, sys

LOG, TARGET = os.environ["TAPLLM_PREPARE_LOG"], "tapllm.engine.input_processor"


def _patch(module):
    original = module.InputProcessor.prepare

    def prepare(self, *args, **kwargs):
        with open(LOG, "a") as f:
            f.write(f"{os.getpid()} {kwargs.get('request_id')}\\n")
        return original(self, *args, **kwargs)

    module.InputProcessor.prepare = prepare


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


@pytest.mark.parametrize("mode", ["core process", "in process"])
def test_each_prompt_is_prepared_once_across_the_process_boundary(tiny_models, tmp_path, mode):
    """The API server prepares each prompt once (InputProcessor.prepare); the engine core only adds
    what it receives. Counted in every process of the server, over a spec with a steer, parallel
    samples of two prompts, a structured output and a refused request."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_COUNTING_SITECUSTOMIZE)
    log = tmp_path / "prepare.log"
    args = ["--enable-hidden-states", "--enable-steering"] + (["--no-engine-process"] if mode == "in process" else [])
    server = Server(tiny_models["llama"], *args, env={"TAPLLM_PREPARE_LOG": str(log)},
                    pythonpath=[str(tmp_path / "site")])
    try:
        steer = {"layers": [0], "point": "resid_post", "vector": [0.5] * 64}
        bodies = [("/v1/completions", {"prompt": "the cat sat on", "max_tokens": 4, "hidden_states": SPEC,
                                       "steering": [steer]}, 1),
                  ("/v1/completions", {"prompt": ["one two", "three four five"], "max_tokens": 3, "n": 2,
                                       "temperature": 0.8, "seed": 1}, 2),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 4,
                                            "structured_outputs": {"choice": ["yes", "no"]}}, 1)]
        for path, body, prompts in bodies:
            code, resp = server.post(path, body)
            assert code == 200, resp
            lines = [line.split() for line in log.read_text().splitlines()]
            mine = [(pid, rid) for pid, rid in lines if rid.startswith(resp["id"] + "-")]
            assert sorted(rid for _, rid in mine) == [f"{resp['id']}-{i}" for i in range(prompts)]  # once each
            assert {int(pid) for pid, _ in mine} == {server.proc.pid}  # in the API server, never in the core
        before = len(log.read_text().splitlines())
        code, resp = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                     "steering": [{**steer, "layers": [9]}]})
        assert code == 400 and "layer 9 is out of range" in resp["error"]["message"], resp
        assert len(log.read_text().splitlines()) == before + 1  # refused where it was prepared, once
        if mode == "core process":
            assert core_pid(server) != server.proc.pid
    finally:
        server.stop()
