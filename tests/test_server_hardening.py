"""Hardening of the HTTP server (issue 10, section 4 and section 2 over HTTP).

Bounded cost per request (body size, length before tokenizing, hidden states per HTTP
request, prompts per request), valid JSON always, bounded metrics series, auth before
parsing, header/body read timeouts, a bounded shutdown under load, 4xx for bad input, and
one bad request never hurting the good ones in flight with it.
"""

from __future__ import annotations

import http.client
import json
import math
import signal
import socket
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import random_prompts
from server_util import KEY, Server
from tapllm.outputs import Logprob

pytest.importorskip("openai")

# Figures the tests measured, printed at the end of the module (pytest -s shows them).
FIGURES: dict[str, str] = {}

BOOM_PLUGIN = """
    class Boom:
        def start(self, num_layers, width, device):
            pass

        def update(self, rows, positions):
            raise RuntimeError("boom: this reducer always fails in update")

        def finish(self):
            raise AssertionError("never reached")


    class BoomAtStart:
        def start(self, num_layers, width, device):
            raise RuntimeError("boom: this reducer fails in start")
"""


def _strict_loads(text: str | bytes):
    """``json.loads`` that refuses NaN and Infinity (which are not JSON)."""
    def refuse(name: str):
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if FIGURES:
        print("\n" + "\n".join(f"{k}: {v}" for k, v in FIGURES.items()))


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    """A folder with a ``tapllm.reducers`` plugin "boom" that raises inside ``update``."""
    root = tmp_path_factory.mktemp("boom_plugin")
    (root / "tapllm_boom_plugin.py").write_text(textwrap.dedent(BOOM_PLUGIN))
    dist = root / "tapllm_boom_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tapllm-boom-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tapllm.reducers]\nboom = tapllm_boom_plugin:Boom\n"
                                              "boom_at_start = tapllm_boom_plugin:BoomAtStart\n")
    return str(root)


@pytest.fixture(scope="module")
def hard(tiny_models, plugin_path, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    s = Server(tiny_models["llama"], "--enable-hidden-states", "--enable-steering", "--api-key-file", str(key_file),
               "--hidden-states-max-bytes", "400000", "--max-num-seqs", "32", "--max-request-bytes", "12000000",
               "--max-prompts-per-request", "8", "--header-read-timeout", "2", "--body-read-timeout", "4",
               # the half-open test holds 200 connections from this address (test_server_edges: the per-client limit)
               "--max-connections-per-client", "1000", pythonpath=[plugin_path])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def defaults(tiny_models):
    """Default limits but a small connection limit; the API key comes from the environment."""
    s = Server(tiny_models["llama"], "--max-connections", "20", env={"TAPLLM_API_KEY": "env-key"}, key="env-key")
    yield s
    s.stop()


def _raw(port: int, data: bytes, read_timeout: float = 10.0) -> bytes:
    """Send raw bytes on a new connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), _strict_loads(body) if body else {}


def _headers(path: str, length: int | None = None, chunked: bool = False, key: str | None = KEY,
             content_type: str = "application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _stream(server: Server, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, list]:
    """POST a streaming request: (status, [event dicts and "[DONE]"]) or (status, error body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
    resp = conn.getresponse()
    if resp.status != 200:
        return resp.status, _strict_loads(resp.read())
    events: list = []
    for line in resp:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            events.append("[DONE]" if payload == b"[DONE]" else _strict_loads(payload))
    conn.close()
    return 200, events


def _stream_text(events: list) -> str:
    return "".join(e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))


# ---- 1. body size, length before tokenizing, /health stays responsive, memory ------------------
def test_body_limits_refuse_before_parsing(hard, defaults):
    # Declared too large: 413 from the headers alone (the body is never sent), naming the flag.
    status, body = _status_and_body(_raw(defaults.port, _headers("/v1/completions", 10_000_000, key="env-key")))
    assert status == 413 and "--max-request-bytes" in body["error"]["message"]
    assert "8,388,608" in body["error"]["message"]  # the default, 8 MiB
    # Chunked, no length given: counted while read, 413 once past the limit.
    limit = 12_000_000
    with socket.create_connection(("127.0.0.1", hard.port), timeout=30) as sock:
        sock.sendall(_headers("/v1/completions", chunked=True))
        piece = b"x" * (1 << 20)
        sent = 0
        while sent + len(piece) < limit:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        time.sleep(0.5)  # let the server read all of it, then cross the limit with one small chunk
        tail = b"y" * (limit - sent + 10)
        sock.sendall(b"%x\r\n%s\r\n" % (len(tail), tail))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, body = _status_and_body(answer)
    assert status == 413 and "12,000,000 bytes (--max-request-bytes)" in body["error"]["message"]
    assert hard.get("/health")[0] == 200


def test_huge_prompts_refused_before_tokenizing_and_health_stays_responsive(hard):
    huge = "word " * 2_000_000  # 10 MB: fits the body limit (12 MB), never the context (512 tokens)
    bodies = [{"prompt": huge, "max_tokens": 2}, {"messages": [{"role": "user", "content": huge}], "max_tokens": 2},
              {"prompt": ["short", huge], "max_tokens": 2}]
    for _ in range(3):  # warm up: allocator pools, worker threads
        hard.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    rss_before = hard.rss_mb()
    latencies: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            assert hard.get("/health", key=None)[0] == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    t0 = time.perf_counter()
    results = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(hard.post, "/v1/chat/completions" if "messages" in b else "/v1/completions", b)
                       for _ in range(4) for b in bodies[:2]]
            futures += [pool.submit(hard.post, "/v1/completions", bodies[2]) for _ in range(2)]
            results = [f.result() for f in futures]
    finally:
        stop.set()
        poller.join()
    elapsed = time.perf_counter() - t0
    for status, body in results:
        assert status == 400, body
        assert "bytes of text, more than the model's context of 512 tokens" in body["error"]["message"]
    assert "prompt[1] is 10,000,000 bytes" in results[-1][1]["error"]["message"]
    time.sleep(1.0)  # the trim after a large body runs on a worker thread
    rss_after = hard.rss_mb()
    FIGURES["10 MB-body requests (10, 2 at a time)"] = f"{elapsed:.1f} s, all 400 before tokenizing"
    FIGURES["server RSS before/after the 10 MB bodies"] = f"{rss_before:.0f} MB -> {rss_after:.0f} MB"
    FIGURES["/health latency meanwhile"] = f"max {max(latencies) * 1000:.0f} ms over {len(latencies)} polls"
    assert max(latencies) < 2.0
    assert rss_after - rss_before < 100, (rss_before, rss_after)
    # A long prompt under the limit is tokenized (off the loop) and refused by its token count.
    status, body = hard.post("/v1/completions", {"prompt": "word " * 2000, "max_tokens": 2})
    assert status == 400 and "max_model_len" in body["error"]["message"]


# ---- 2. hidden states per HTTP request, prompts per request, valid JSON ------------------------
def test_hidden_states_limit_covers_the_whole_request(hard):
    spec = {"layers": "all", "points": ["resid_post"], "positions": "prompt"}  # 100 x 3 x 64 x 4 = 76,800 bytes
    prompts = random_prompts([100] * 9, seed=3)
    status, body = hard.post("/v1/hidden_states", {"input": prompts[:4], "hidden_states": spec})
    assert status == 200 and len(body["data"]) == 4
    status, body = hard.post("/v1/hidden_states", {"input": prompts[:8], "hidden_states": spec})
    assert status == 400 and "614,400 bytes together" in body["error"]["message"]
    assert "--hidden-states-max-bytes" in body["error"]["message"]
    status, body = hard.post("/v1/completions", {"prompt": prompts[:8], "max_tokens": 1,
                                                 "hidden_states": {**spec, "positions": "all"}})
    assert status == 400 and "--hidden-states-max-bytes" in body["error"]["message"]
    for path, body in (("/v1/hidden_states", {"input": prompts}), ("/v1/completions", {"prompt": prompts})):
        status, body = hard.post(path, body)
        assert status == 400 and "9 prompts" in body["error"]["message"], body
        assert "--max-prompts-per-request" in body["error"]["message"]


def test_responses_are_always_valid_json(hard):
    # A reduction over an empty window is NaN: with encoding "list" it must come back as null.
    # (Generated positions, but the request stops at its first token: nothing generated is run.)
    greedy = {"prompt": "Hi", "temperature": 0}
    first = hard.post("/v1/completions", {**greedy, "max_tokens": 1})[1]["choices"][0]["text"]
    assert first
    spec = {"layers": [0], "positions": "generated", "reduce": "mean", "encoding": "list"}
    bad = {**greedy, "max_tokens": 4, "stop": [first], "hidden_states": spec}
    body = _strict_loads(urllib_request(hard, "/v1/completions", bad))
    assert body["choices"][0]["finish_reason"] == "stop"
    data = body["choices"][0]["hidden_states"]["points"]["resid_post"]["data"]
    assert data[0][0] is None
    status, events = _stream(hard, "/v1/completions", {**bad, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    final = [e for e in events if isinstance(e, dict) and e["choices"][0]["finish_reason"]][0]
    assert final["choices"][0]["hidden_states"]["points"]["resid_post"]["data"][0][0] is None
    # An echoed lone surrogate (in an error message) still makes a valid JSON body.
    status, body = hard.post("/v1/completions", b'{"prompt": "Hi", "model": "a\\ud800b"}')
    assert status == 404 and "does not exist" in body["error"]["message"]


def urllib_request(server: Server, path: str, obj: dict) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, json.dumps(obj), {"Content-Type": "application/json",
                                                 "Authorization": f"Bearer {server.key}"})
    resp = conn.getresponse()
    data = resp.read()
    assert resp.status == 200, data
    return data


def test_logprobs_of_minus_infinity_are_written_as_vllm_does():
    from tapllm.server.errors import dumps
    from tapllm.server.formatting import chat_logprobs, completion_logprobs

    tokenizer = SimpleNamespace(decode=lambda ids: f"t{ids[0]}")
    entries = [{5: Logprob(-math.inf, 2), 6: Logprob(0.0, 1)}]
    got = completion_logprobs([5], entries, tokenizer, 2)
    assert got["token_logprobs"] == [-9999.0] and got["top_logprobs"] == [{"t6": 0.0, "t5": -9999.0}]
    assert chat_logprobs([5], entries, tokenizer, 1)[0]["logprob"] == -9999.0
    assert _strict_loads(dumps({"a": [math.nan, math.inf, 1.5]})) == {"a": [None, None, 1.5]}


# ---- 3. metrics by route -------------------------------------------------------------------------
def test_metrics_label_requests_by_route(hard):
    for i in range(60):
        assert hard.get(f"/no/such/path/{i}")[0] == 404
    assert hard.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0] == 200
    _, text = hard.get("/metrics")
    series = [line for line in text.splitlines() if line.startswith("tapllm_requests_total{")]
    assert not any("/no/such" in line for line in series)
    assert any('endpoint="unmatched"' in line and 'status="404"' in line for line in series)
    assert any('endpoint="/v1/completions"' in line and 'status="200"' in line for line in series)
    assert len(series) < 20, series


# ---- 5. auth first, key not on the command line -------------------------------------------------
def test_only_health_is_open_and_auth_comes_before_parsing(hard, defaults):
    for path in ("/docs", "/redoc", "/openapi.json", "/metrics", "/v1/models", "/no/such/path"):
        status, body = hard.get(path, key=None)
        assert status == 401 and body["error"]["code"] == 401 and body["error"]["type"] == "Unauthorized", path
    assert hard.get("/health", key=None)[0] == 200
    assert hard.post("/v1/completions", b'{"prompt": ', key=None)[0] == 401  # malformed: 401, not 400
    assert hard.post("/v1/completions", b'{"prompt": ', key="wrong")[0] == 401
    assert hard.post("/v1/completions", b'{"prompt": ')[0] == 400
    assert _status_and_body(_raw(hard.port, _headers("/v1/completions", 50_000_000, key=None)))[0] == 401
    status, schema = hard.get("/openapi.json")
    assert status == 200 and "CompletionRequest" in schema["components"]["schemas"]
    assert hard.get("/docs")[0] == 200
    # the key came from --api-key-file (hard) and $TAPLLM_API_KEY (defaults): not visible in ps
    for server in (hard, defaults):
        assert server.key.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert defaults.get("/v1/models", key=None)[0] == 401
    assert defaults.get("/v1/models")[0] == 200


# ---- 6. header and body read timeouts, connection limit ----------------------------------------
def test_half_open_connections_are_closed_and_health_keeps_answering(hard):
    n = 200
    socks = []
    t0 = time.perf_counter()
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", hard.port), timeout=15)
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        socks.append(s)
    # a kept-alive connection that starts its next request and stalls
    conn = http.client.HTTPConnection("127.0.0.1", hard.port, timeout=15)
    conn.request("GET", "/health")
    assert conn.getresponse().read()
    conn.sock.sendall(b"GET /health HTTP/1.1\r\n")
    socks.append(conn.sock)
    health = []
    while time.perf_counter() - t0 < 1.5:
        t = time.perf_counter()
        assert hard.get("/health", key=None)[0] == 200
        health.append(time.perf_counter() - t)
    closed_at = []
    for s in socks:
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        closed_at.append(time.perf_counter() - t0)
        assert data in (b"", ) or data.startswith(b"HTTP/1.1 408"), data
        s.close()
    FIGURES["half-open connections"] = (f"{len(socks)} held; all closed by the server {max(closed_at):.1f} s after "
                                        f"opening (--header-read-timeout 2); /health meanwhile: {len(health)} "
                                        f"answers, max {max(health) * 1000:.0f} ms")
    assert max(closed_at) < 8
    assert hard.get("/health", key=None)[0] == 200


def test_connection_limit(defaults):
    idle = [socket.create_connection(("127.0.0.1", defaults.port), timeout=10) for _ in range(20)]
    try:
        time.sleep(0.3)
        assert defaults.get("/health")[0] == 503  # --max-connections 20: uvicorn answers 503 beyond
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)
    assert defaults.get("/health")[0] == 200


def test_body_read_timeout(hard):
    t0 = time.perf_counter()
    answer = _raw(hard.port, _headers("/v1/completions", 100) + b'{"prompt": ', read_timeout=15)
    status, body = _status_and_body(answer)
    assert status == 408 and "--body-read-timeout" in body["error"]["message"]
    assert 3 < time.perf_counter() - t0 < 10


# ---- 7. bad input is a 4xx -----------------------------------------------------------------------
def test_bad_input_is_4xx_not_500(hard):
    ok = {"prompt": "Hi", "max_tokens": 2}
    user = {"role": "user", "content": "Hi"}
    cases = [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt is not valid Unicode"),
        ("/v1/completions", b'{"prompt": ["ok", "a\\ud800b"], "max_tokens": 2}', 400, "prompt[1] is not valid"),
        ("/v1/completions", b'{"prompt": "Hi", "stop": ["\\udfff"], "max_tokens": 2}', 400, "stop[0] is not valid"),
        ("/v1/hidden_states", b'{"input": "a\\ud800b"}', 400, "input is not valid Unicode"),
        ("/v1/chat/completions", b'{"messages": [{"role": "u\\ud800", "content": "Hi"}]}', 400,
         "messages[0].role is not valid Unicode"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
         "messages[0].content is not valid Unicode"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         400, "messages[0].content[0].text is not valid Unicode"),
        ("/v1/chat/completions", {"messages": [user], "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [user], "max_completion_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2}, 400,
         "messages[0].content is required"),
        ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/completions", {**ok, "logprobs": -1}, 400, "logprobs must be >= 0"),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "malformed JSON body"),
        ("/v1/completions", b'\xff\xfe{"prompt": 1}', 400, "malformed JSON body"),
    ]
    for path, body, status, message in cases:
        code, resp = hard.post(path, body)
        assert code == status and message in resp["error"]["message"], (body[:80], resp)
    # an assistant turn may omit content
    code, resp = hard.post("/v1/chat/completions", {"messages": [user, {"role": "assistant"}, user], "max_tokens": 2})
    assert code == 200, resp
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded"):
        code, resp = hard.post("/v1/completions", ok, content_type=ctype)
        assert code == 415 and "Content-Type must be application/json" in resp["error"]["message"], ctype
    assert hard.post("/v1/completions", ok, content_type="application/json; charset=utf-8")[0] == 200
    assert hard.post("/health", ok, content_type=None)[0] == 405  # a route that takes no POST: 405, not 415
    assert hard.metric("tapllm_engine_step_errors_total") == 0


# ---- 2 over HTTP, and 8: one bad request among good ones ----------------------------------------
GOOD_PROMPTS = random_prompts([4, 7, 11, 5, 9, 13, 6, 8], seed=21)


def _good(i: int) -> tuple[str, dict]:
    body = {"prompt": GOOD_PROMPTS[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if i % 2:
        body["stream"] = True
    return "/v1/completions", body


def _send(server: Server, path: str, body: dict | bytes) -> tuple[int, object]:
    streaming = isinstance(body, dict) and body.get("stream")
    if streaming:
        return _stream(server, path, body)
    return server.post(path, body)


def _text(status: int, result) -> str:
    assert status == 200, result
    if isinstance(result, list):
        assert result[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in result), result
        return _stream_text(result)
    return result["choices"][0]["text"]


def _nan_temperature() -> bytes:
    return json.dumps({"prompt": "Hi", "max_tokens": 4, "temperature": float("nan")}).encode()  # sends NaN


BAD_CASES = [
    ("temperature NaN", "/v1/completions", _nan_temperature(), "temperature"),
    # below 1e-5 the engine decodes greedily, as vLLM does: a valid request, answered 200
    ("temperature 1e-45", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-45}, None),
    ("top_p 1e-300", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 1, "top_p": 1e-300},
     "top_p"),
    ("logprobs 49153", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logprobs": 49153}, "logprobs"),
    ("logprobs 1e9", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 4, "logprobs": 1e9}', "logprobs"),
    ("chat top_logprobs 1e6", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 10**6},
     "top_logprobs"),
    ("steering scale 1e38 x 10", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 4, "steering": [{"layers": [0], "vector": [10.0] * 64, "scale": 1e38}]},
     "steering"),
    ("seed 2**64", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 1, "seed": 2**64}, "seed"),
    ("lone surrogate prompt", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
    ("lone surrogate chat content", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}', "content"),
    ("lone surrogate chat role", "/v1/chat/completions",
     b'{"messages": [{"role": "\\ud800", "content": "Hi"}], "max_tokens": 4}', "role"),
]


@pytest.fixture(scope="module")
def alone(hard) -> list[str]:
    """What each good request returns when it runs alone."""
    return [_text(*_send(hard, *_good(i))) for i in range(8)]


def test_bad_requests_among_good_ones_fail_alone(hard, alone):
    table = []
    for name, path, bad, field in BAD_CASES:
        with ThreadPoolExecutor(9) as pool:
            good = [pool.submit(_send, hard, *_good(i)) for i in range(8)]
            status, resp = pool.submit(_send, hard, path, bad).result()
            texts = [_text(*f.result()) for f in good]
        table.append(f"{name}: {status}")
        if field is None:
            assert status == 200, (name, resp)
        else:
            assert 400 <= status < 500, (name, status, resp)
            assert field in resp["error"]["message"], (name, resp)
        assert texts == alone, name
    FIGURES["bad input among 8 good requests"] = "; ".join(table)
    assert hard.metric("tapllm_engine_step_errors_total") == 0


def test_failing_reducer_plugin_fails_alone(hard, alone):
    states = {"layers": [0], "points": ["resid_post"], "positions": "all", "reduce": "boom"}
    for stream in (False, True):
        bad = {"prompt": "Hello there", "max_tokens": 4, "hidden_states": states, "stream": stream}
        with ThreadPoolExecutor(9) as pool:
            good = [pool.submit(_send, hard, *_good(i)) for i in range(8)]
            status, resp = pool.submit(_send, hard, "/v1/completions", bad).result()
            texts = [_text(*f.result()) for f in good]
        assert texts == alone
        if stream:
            assert status == 200 and resp[-1] == "[DONE]", resp
            error = resp[-2]["error"]
        else:
            assert status == 500, resp
            error = resp["error"]
        assert error["type"] == "InternalServerError" and error["code"] == 500 and "boom" in error["message"], error
    assert hard.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200



def test_reducer_failing_at_start_fails_alone_at_once(hard, alone):
    # start() runs as the engine adds the request: it comes back finished, before any step.
    states = {"layers": [0], "points": ["resid_post"], "positions": "all", "reduce": "boom_at_start"}
    for stream in (False, True):
        bad = {"prompt": "Hello there", "max_tokens": 4, "hidden_states": states, "stream": stream}
        status, resp = _send(hard, "/v1/completions", bad)
        error = resp[-2]["error"] if stream else resp["error"]
        assert status == (200 if stream else 500) and error["type"] == "InternalServerError", resp
        assert "starting the capture failed" in error["message"] and "fails in start" in error["message"], error
    assert [_text(*_send(hard, *_good(i))) for i in range(8)] == alone

# ---- 4. shutdown under load ---------------------------------------------------------------------
def _load(server: Server, n_streams: int, n_plain: int) -> tuple[list, threading.Barrier]:
    """Start ``n_streams`` long streams and ``n_plain`` long non-stream requests in threads."""
    results: list = [None] * (n_streams + n_plain)
    started = threading.Barrier(n_streams + 1, timeout=120)
    prompts = random_prompts([5] * (n_streams + n_plain), seed=5)

    def run_stream(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"prompt": prompts[i], "max_tokens": 500, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
        resp = conn.getresponse()
        events = []
        first = True
        try:
            for line in resp:
                if line.startswith(b"data: "):
                    payload = line.strip()[len(b"data: "):]
                    events.append("[DONE]" if payload == b"[DONE]" else _strict_loads(payload))
                    if first:
                        first = False
                        started.wait()
        except (ConnectionError, http.client.HTTPException) as exc:
            events.append(f"cut: {exc!r}")
        results[i] = (resp.status, events, time.perf_counter())

    def run_plain(i: int) -> None:
        status, body = server.post("/v1/completions", {"prompt": prompts[i], "max_tokens": 500, "ignore_eos": True},
                                   timeout=120)
        results[i] = (status, body, time.perf_counter())

    threads = [threading.Thread(target=run_stream, args=(i,)) for i in range(n_streams)]
    threads += [threading.Thread(target=run_plain, args=(n_streams + i,)) for i in range(n_plain)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first event
    return results, threads


def _check_ends(results: list, n_streams: int) -> tuple[int, int]:
    """Every stream ended with [DONE] (after its finish or an error event); returns (finished, aborted)."""
    finished = aborted = 0
    for status, events, _ in results[:n_streams]:
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        if isinstance(events[-2], dict) and "error" in events[-2]:
            assert events[-2]["error"]["type"] == "ServiceUnavailableError"
            assert "shutting down" in events[-2]["error"]["message"]
            aborted += 1
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            finished += 1
    for status, body, _ in results[n_streams:]:
        assert status in (200, 503), body
        if status == 503:
            assert "shutting down" in body["error"]["message"]
            aborted += 1
        else:
            finished += 1
    return finished, aborted


@pytest.mark.parametrize("second_signal", [False, True], ids=["sigterm-grace", "sigterm-then-sigint"])
def test_shutdown_under_load(tiny_models, second_signal):
    grace = 30.0 if second_signal else 1.0
    server = Server(tiny_models["llama"], "--max-num-seqs", "64", "--shutdown-timeout", str(grace), key=None)
    try:
        n_streams, n_plain = 32, 4
        results, threads = _load(server, n_streams, n_plain)
        t0 = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGINT)
        else:
            time.sleep(0.3)  # draining: new connections are refused (or answered 503)
            try:
                status, _ = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=5)
                assert status == 503
            except OSError:
                pass
        server.proc.wait(timeout=grace + 15)
        exited = time.perf_counter() - t0
        for t in threads:
            t.join(timeout=30)
        finished, aborted = _check_ends(results, n_streams)
        last_end = max(r[2] for r in results) - t0
        assert server.proc.returncode == 0, server.output()[-2000:]
        label = "SIGTERM then SIGINT" if second_signal else f"SIGTERM, --shutdown-timeout {grace:g}"
        FIGURES[f"shutdown ({label}), 32 streams + 4 non-stream in flight"] = (
            f"process exited {exited:.2f} s after the first signal; last response ended at {last_end:.2f} s; "
            f"{finished} finished, {aborted} aborted with an error event/503")
        if second_signal:
            assert aborted == n_streams + n_plain and exited < 5
        else:
            assert exited < grace + 6
    finally:
        server.stop()


def test_api_key_sources(tmp_path, monkeypatch):
    from tapllm.cli import build_parser
    from tapllm.cli.serve import _api_key

    def key(*argv: str) -> str | None:
        return _api_key(build_parser().parse_args(["serve", *argv]))

    monkeypatch.delenv("TAPLLM_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("TAPLLM_API_KEY", "from-env\n")
    assert key() == "from-env"
    assert key("--api-key", "flag") == "flag"
    (tmp_path / "k").write_text("from-file\nsecond line\n")
    assert key("--api-key-file", str(tmp_path / "k")) == "from-file"
    (tmp_path / "empty").write_text("\n")
    for argv, message in ((["--api-key-file", str(tmp_path / "empty")], "is empty"),
                          (["--api-key-file", str(tmp_path / "missing")], "cannot read"),
                          (["--api-key", "a", "--api-key-file", str(tmp_path / "k")], "not both")):
        with pytest.raises(ValueError, match=message):
            key(*argv)
