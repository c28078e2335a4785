"""Quiet and exact edges of the server (issue 50, item 5).

One client's half-open connections cannot starve another (``--max-connections-per-client``); a
client that disconnects is logged once at debug level with no traceback, and every such abort is
counted; values out of the range of the dtype they are computed in are a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import time
from types import SimpleNamespace

import pytest
import zmq

from server_util import KEY, Server
from tapllm.engine.llm_engine import EngineStats
from tapllm.server import ipc
from tapllm.server.async_engine import AsyncEngine
from tapllm.server.bodies import until_disconnect
from tapllm.server.core_client import CoreClient, _Replica
from tapllm.server.errors import APIError
from tapllm.server.runner import Update

HALF_OPEN = 1000
PER_CLIENT = 100  # the default of --max-connections-per-client


@pytest.fixture(scope="module")
def edges(tiny_models):
    """Default connection limits; a header timeout long enough for a loaded machine to open 1,000 connections."""
    s = Server(tiny_models["llama"], "--enable-steering", "--enable-hidden-states", "--max-num-seqs", "16",
               "--header-read-timeout", "60")
    yield s
    s.stop()


def _readable(sock: socket.socket) -> bytes | None:
    """What the server sent on ``sock`` so far (``b""``: it closed), or None when it is open and silent."""
    sock.setblocking(False)
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""
    finally:
        sock.setblocking(True)
    return data


def test_one_clients_half_open_connections_do_not_starve_another(edges):
    t0 = time.perf_counter()
    socks = []
    for _ in range(HALF_OPEN):  # one client, from its own address (the whole of 127/8 is this machine)
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.settimeout(10)
        s.connect(("127.0.0.1", edges.port))
        socks.append(s)
    try:
        answers: list[bytes | None] = [None] * len(socks)
        deadline = time.monotonic() + 30  # the server makes (or refuses) every connection, however loaded
        while time.monotonic() < deadline:
            answers = [a if a is not None else _readable(s) for s, a in zip(socks, answers)]
            if sum(a is not None for a in answers) >= HALF_OPEN - PER_CLIENT:
                break
            time.sleep(0.2)
        time.sleep(0.5)  # and nothing more is refused
        answers = [a if a is not None else _readable(s) for s, a in zip(socks, answers)]
        held = [s for s, a in zip(socks, answers) if a is None]
        refused = [a for a in answers if a is not None]
        assert len(held) == PER_CLIENT, (len(held), refused[:1])
        assert all(a.startswith(b"HTTP/1.1 503") and b"--max-connections-per-client" in a for a in refused)
        for s in held:  # headers sent byte by byte, never finished
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # another client is served, at once
        t = time.perf_counter()
        code, body = edges.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert code == 200 and body["choices"][0]["text"] is not None
        assert edges.get("/health", key=None)[0] == 200
        served = time.perf_counter() - t
        assert all(_readable(s) is None for s in held)  # and the first client's connections were still held
        assert time.perf_counter() - t0 < 60  # within --header-read-timeout: none had been timed out
    finally:
        for s in socks:
            s.close()
    assert served < 5, served


def _request(port: int, body: dict, source: str) -> socket.socket:
    """A connection from ``source`` that has sent one whole completions request."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _settled(edges: Server, name: str, want: float, deadline_s: float = 60) -> float:
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        value = edges.metric(name)
        if value == want and edges.metric("tapllm_requests_running") == 0 \
                and edges.metric("tapllm_requests_waiting") == 0:
            break
        time.sleep(0.2)
    return edges.metric(name)


def test_every_disconnect_is_counted_and_none_logs_an_error(edges):
    n = 100
    before = edges.metric("tapllm_requests_aborted_total")
    socks = [_request(edges.port, {"prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True},
                      "127.0.0.3") for _ in range(n)]  # a client of its own: /metrics is read meanwhile
    deadline = time.time() + 30
    while edges.metric("tapllm_requests_running") == 0 and time.time() < deadline:
        time.sleep(0.05)
    answered = 0
    for s in socks:  # each client leaves mid-request (one answered already would not be an abort)
        answered += _readable(s) is not None
        s.close()
    got = _settled(edges, "tapllm_requests_aborted_total", before + n - answered)
    assert got - before == n - answered and n - answered >= n // 2, (got - before, answered)
    log = edges.output()
    for noise in ("never retrieved", "Traceback", "ERROR", "aborted request"):
        assert noise not in log, log[-3000:]
    assert edges.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


# ---- the aborted counter: each runner, the race the issue saw (the result ready, its reader gone) ---------
def _core_client() -> tuple[CoreClient, list]:
    """A ``CoreClient`` of one stand-in core: what it sends is kept, what the core says is fed to ``_dispatch``."""
    sent: list = []
    replica = _Replica(sync_sock=None, pid=0)
    replica.sock = SimpleNamespace(send_multipart=lambda frames, copy=False: sent.append(ipc.decode_inbound(frames[0])))
    frontend = SimpleNamespace(config=SimpleNamespace(block_size=16))
    return CoreClient(zmq.Context.instance(), [replica], frontend, num_kv_blocks=8), sent


def _finished_by_core(client: CoreClient, rid: str) -> None:
    stats = EngineStats(0, 0, 0.0, 0, 0, 0)
    frames = ipc.pack(ipc.Outputs([ipc.UpdateMsg(rid, "done", [5], finished=True)], stats, 0))
    client._dispatch(0, [zmq.Frame(f) for f in frames])


def _async_engine() -> AsyncEngine:
    """An ``AsyncEngine`` whose thread is not started: updates are pushed to its streams by hand."""
    engine = SimpleNamespace(input_processor=SimpleNamespace(grammars=SimpleNamespace(warm_in_background=lambda: None)),
                             stats=lambda: EngineStats(0, 0, 0.0, 0, 0, 0))
    return AsyncEngine(engine)


def _finished_by_engine(runner: AsyncEngine, rid: str) -> None:
    runner._active[rid].queue.put_nowait(Update("done", [5], None, finished=True))


@pytest.mark.parametrize("kind", ["core", "thread"])
def test_every_abort_is_counted_once(kind):
    """A request whose result reached the server but not its client (the reader left first) is an abort; a
    request read to its end is not; one the shutdown ended counts once, whether or not its reader stays."""
    async def main() -> list[int]:
        runner, finish = (_core_client()[0], _finished_by_core) if kind == "core" else \
            (_async_engine(), _finished_by_engine)
        counts = []

        async def read(rid: str, leave_after_finish: bool) -> None:
            gen = runner.generate(SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2, 3]))
            reader = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)  # the request is sent; its reader waits
            finish(runner, rid)
            if leave_after_finish:
                reader.cancel()  # the client left as its result arrived
                with pytest.raises(asyncio.CancelledError):
                    await reader
            else:
                assert (await reader).finished
                with pytest.raises(StopAsyncIteration):
                    await gen.__anext__()
            await gen.aclose()
            counts.append(runner.stats.requests_aborted)

        await read("a", leave_after_finish=True)
        await read("b", leave_after_finish=False)
        gens = [runner.generate(SimpleNamespace(request_id=r, prompt_token_ids=[1])) for r in ("c", "d")]
        readers = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)
        assert runner.abort_all("shutting down") == 2
        assert (await readers[0]).error_type == "service_unavailable"
        readers[1].cancel()  # this one's reader is gone too
        await asyncio.gather(readers[1], return_exceptions=True)
        for g in gens:
            await g.aclose()
        counts.append(runner.stats.requests_aborted)
        return counts

    assert asyncio.run(main()) == [1, 1, 3]


def test_a_disconnect_is_logged_once_at_debug_level_without_a_traceback(caplog):
    class Gone:
        """A request whose client has left."""

        async def is_disconnected(self) -> bool:
            return True

    async def main() -> list[dict]:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        waiting = [asyncio.ensure_future(asyncio.sleep(3600)) for _ in range(3)]
        with pytest.raises(APIError) as exc:
            await until_disconnect(Gone(), asyncio.gather(*waiting), "cmpl-1-0")
        assert exc.value.status == 499
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()  # a future whose exception nobody retrieved is reported when it is collected
        await asyncio.sleep(0)
        assert all(t.cancelled() for t in waiting)
        return errors

    with caplog.at_level(logging.DEBUG, logger="tapllm"):
        errors = asyncio.run(main())
    assert errors == []
    mine = [r for r in caplog.records if r.name == "tapllm"]
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in mine] == \
        [(logging.DEBUG, "the client of cmpl-1-0 disconnected: aborted", None)]


def _vec(value: float) -> list[float]:
    return [value] * 64


@pytest.mark.parametrize("extra, field", [
    ({"steering": [{"layers": [0], "vector": _vec(1e39)}]}, "steering.vector holds 1e+39, beyond the range of float32"),
    ({"steering": [{"layers": [0], "vector": {"0": _vec(-1e39)}}]}, "steering.vector[0] holds 1e+39"),
    ({"steering": [{"layers": [0], "vector": {"shape": [64], "dtype": "float16", "data": _vec(1e5)}}]},
     "steering.vector.data holds 100000, beyond the range of float16"),
    ({"steering": [{"layers": [0], "vector": _vec(1.0), "scale": 1e39}]}, "steering.scale is 1e+39"),
    ({"steering": [{"layers": [0], "op": "clamp", "vector": _vec(1.0), "value": 1e39}]}, "steering.value is 1e+39"),
    ({"steering": [{"layers": [0], "op": "set", "positions": [0], "values": [_vec(1e39)]}]},
     "steering.values holds 1e+39"),
    ({"steering": [{"layers": [0], "vector": _vec(3e38)}, {"layers": [1], "vector": _vec(3e38), "scale": 2}]},
     "steering[1]: scale * vector at layer 1 overflows"),
    ({"hidden_states": {"project": [_vec(1e39)]}}, "hidden_states.project holds 1e+39"),
    ({"temperature": 1e39}, "temperature is 1e+39, beyond the range of float32"),
    ({"top_p": 1e39}, "top_p"),
])
def test_values_beyond_their_dtype_are_a_400_naming_the_field(edges, extra, field):
    code, body = edges.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **extra})
    assert code == 400 and field in body["error"]["message"], body
    assert "overflow encountered" not in edges.output() and "RuntimeWarning" not in edges.output()
