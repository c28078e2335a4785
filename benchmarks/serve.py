"""Serving throughput of ``tapllm serve`` with and without hidden states, over real HTTP.

What it measures
    A real server (``tapllm serve``, uvicorn, default model) in a subprocess, and N client
    threads using the official ``openai`` client. Each client sends its requests one after
    another, streaming (``stream=true``), random-token prompts of equal length, greedy, EOS
    ignored so each request yields exactly ``--new-tokens`` tokens. Two workloads over the same
    prompts:

      plain   no hidden states
      states  ``hidden_states={"layers": [1, L/2, L-1], "points": ["resid_pre"], "positions":
              "prompt"}`` (3 blocks, every prompt position), base64-encoded, in the final chunk

    Workloads run in turn, in reverse order every other round, for ``--rounds`` rounds so drift
    of the machine does not favour one; each workload's best round counts. Every run gets
    prompts of its own, so no run is served from the prefix cache of another (a request
    capturing prompt positions recomputes them, a plain one would reuse them: that would
    measure caching, not capture). Reported per
    workload: requests/s, output tokens/s, time to first token (first text chunk) p50/p99,
    and the response bytes received. Then one request's response size with base64 against
    nested float lists (``encoding="list"``), non-streaming, same states.

Engine core process against in-process (``--compare-processes``)
    The same server started twice: with the engine core in its own process (the default) and
    with ``--no-engine-process``. In each, ``--clients`` streaming clients (default 64), of which
    three quarters are plain and one quarter ask for every block's ``resid_post`` at every
    position (base64). The plain clients each send one request of ``--new-tokens``; the state
    clients send requests of a quarter of that, one after another, until the plain clients are
    done, so states are encoded all through the plain streams. Measured on the plain clients:
    inter-token latency (time between successive text chunks) p50/p99 and output tokens/s;
    once without the looping clients, once with them looping the same requests without states
    (their prefills alone), once with states. Target: with the engine in its own process, p99
    ITL of the plain clients with state clients within 1.5x of the run without. All of it at
    each token budget of ``--budgets`` (the servers' ``--max-num-batched-tokens``; default
    2048, the default of ``tapllm serve``, and 256): the budget bounds the prompt tokens that
    share a step with the plain clients' decodes, so it trades the state clients' prefill
    throughput for the plain clients' p99 latency.
    Raw HTTP (``http.client``) so the 64 client threads cost as little as possible.

How to run (from the repository root; needs ``pip install openai``)
    python benchmarks/serve.py                        # 16 clients x 4 requests, prompt 256, 64 new
    python benchmarks/serve.py --quick                # 4 clients x 2 requests, prompt 64, 16 new
    python benchmarks/serve.py --clients 32 --rounds 3
    python benchmarks/serve.py --compare-processes                  # 64 clients, prompt 256, 64 new
    python benchmarks/serve.py --compare-processes --prompt-len 64 --new-tokens 32   # a loaded machine
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import REPO_ROOT, free_port, launch  # noqa: E402
KEY = "bench-key"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true", help="4 clients x 2 requests, prompt 64, 16 new, 1 round")
    p.add_argument("--serve-args", default="", help="more arguments for tapllm serve (one string)")
    p.add_argument("--compare-processes", action="store_true",
                   help="engine core process vs in-process: ITL of plain clients beside state clients (64 clients)")
    p.add_argument("--budgets", default="2048,256",
                   help="--compare-processes: the servers' --max-num-batched-tokens, each a run of its own")
    args = p.parse_args(argv)
    if args.compare_processes and "--clients" not in (argv if argv is not None else sys.argv):
        args.clients = 64
    if args.quick:
        args.clients, args.requests, args.prompt_len, args.new_tokens, args.rounds = 4, 2, 64, 16, 1
    return args


def start_server(args: argparse.Namespace, port: int, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``tapllm serve`` on the default model; returns once /health answers."""
    cmd = ["--dtype", args.dtype, "--quiet",
           "--enable-hidden-states", "--hidden-states-max-bytes", str(1 << 30), "--api-key", KEY,
           "--max-num-seqs", str(max(16, args.clients)), "--served-model-name", "default", *extra,
           *shlex.split(args.serve_args)]
    return launch(cmd, port)


# A schema of varied shape whose objects take a few dozen tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}


def request_kwargs(kind: str, states: dict, index: int) -> dict[str, Any]:
    """The create() arguments of one request of ``kind`` (plain, states, json, n4)."""
    extra: dict[str, Any] = {"ignore_eos": kind != "json"}
    kw: dict[str, Any] = {"temperature": 0}
    if kind == "states":
        extra["hidden_states"] = states
    elif kind == "json":
        # the client's completions.create has no response_format argument: the server reads it from the body
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    elif kind == "n4":
        kw.update(n=4, temperature=1.0, seed=index)
    kw["extra_body"] = extra
    return kw


def kind_of(workload: str, index: int) -> str:
    """The request kind of the ``index``-th request of ``workload``."""
    if workload == "mixed":
        return ("n4", "json", "states", "plain")[index % 4]
    return workload


def one_request(client: Any, prompt: list[int], new: int, kwargs: dict[str, Any]) -> tuple[float, int, int]:
    """Stream one completion; returns (time to first token, tokens, bytes of the chunks as JSON).

    The byte count re-serializes each parsed chunk, so it approximates what came over the wire.
    """
    t0 = time.perf_counter()
    ttft = None
    received = 0
    stream = client.completions.create(model="default", prompt=prompt, max_tokens=new, stream=True,
                                       stream_options={"include_usage": True}, **kwargs)
    tokens = 0
    for chunk in stream:
        received += len(chunk.model_dump_json())
        if chunk.choices and chunk.choices[0].text and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens, received


def run_workload(url: str, prompts: list[list[int]], args: argparse.Namespace, workload: str, states: dict) -> dict:
    """All clients at once; each sends its share of ``prompts`` in turn."""
    import openai

    clients = [openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
               for _ in range(args.clients)]

    def client_loop(c: int) -> list[tuple[float, int, int]]:
        first = c * args.requests
        mine = prompts[first:first + args.requests]
        return [one_request(clients[c], p, args.new_tokens,
                            request_kwargs(kind_of(workload, first + j), states, first + j))
                for j, p in enumerate(mine)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = [r for rs in pool.map(client_loop, range(args.clients)) for r in rs]
    seconds = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    return {
        "seconds": seconds,
        "req_s": len(results) / seconds,
        "tok_s": sum(r[1] for r in results) / seconds,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "bytes": sum(r[2] for r in results),
        "tokens": sum(r[1] for r in results),
    }


def response_bytes(url: str, prompt: list[int], states: dict) -> int:
    """Size of one non-streaming response body."""
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                       "hidden_states": states}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return len(r.read())


def stream_raw(port: int, body: dict) -> tuple[list[float], int]:
    """Stream one completion over raw HTTP; (times of its text chunks, tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times = []
    for line in resp:
        if line.startswith(b"data: {") and b'"text": ""' not in line[:400]:
            times.append(time.perf_counter())
    conn.close()
    return times, len(times)


def compare_run(port: int, args: argparse.Namespace, prompts: list[list[int]], loops: str) -> dict:
    """Plain clients (three quarters), and a quarter looping while they run: ``loops`` "none" (no such
    clients), "plain" (the same requests without states: their prefills alone) or "states"."""
    with_states = loops != "none"
    n_states = args.clients // 4
    n_plain = args.clients - n_states
    spec = {"layers": "all", "points": ["resid_post"], "positions": "all"}
    done = threading.Event()
    state_requests = [0]

    def plain(i: int) -> tuple[list[float], int]:
        return stream_raw(port, {"model": "default", "prompt": prompts[i], "max_tokens": args.new_tokens,
                                 "temperature": 0, "ignore_eos": True})

    def states(i: int) -> None:
        j = 0
        while not done.is_set():
            prompt = prompts[n_plain + (i + j) % n_states]
            if loops == "plain":  # a fresh prompt each time, as capturing requests recompute theirs
                prompt = [(t + j + 1) % 49000 + 32 for t in prompt]
            body = {"model": "default", "prompt": prompt, "max_tokens": max(2, args.new_tokens // 4),
                    "temperature": 0, "ignore_eos": True}
            stream_raw(port, {**body, "hidden_states": spec} if loops == "states" else body)
            state_requests[0] += 1
            j += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        looping = [pool.submit(states, i) for i in range(n_states)] if with_states else []
        results = list(pool.map(plain, range(n_plain)))
        seconds = time.perf_counter() - t0
        done.set()
        for f in looping:
            f.result()
    gaps = sorted(b - a for times, _ in results for a, b in zip(times, times[1:]))
    return {"itl_p50": statistics.median(gaps), "itl_p99": gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))],
            "tok_s": sum(n for _, n in results) / seconds, "state_requests": state_requests[0]}


def compare_processes(args: argparse.Namespace) -> None:
    """Engine core process against in-process, each with and without state clients, at each token
    budget of ``--budgets``; print the table."""
    rng = random.Random(0)
    rows = []
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"engine core process vs in-process, default model {args.dtype}: {args.clients} streaming clients "
          f"({args.clients - args.clients // 4} plain, {args.clients // 4} asking every block's resid_post at every "
          f"position), prompt {args.prompt_len}, {args.new_tokens} new tokens, token budgets {budgets}", flush=True)
    for budget in budgets:
        for mode, extra in (("engine process", ()), ("in-process", ("--no-engine-process",))):
            port = free_port()
            proc = start_server(args, port, (*extra, "--max-num-batched-tokens", str(budget)))
            try:
                for loops in ("none", "plain", "states"):  # fresh prompts each run: no prefix-cache reuse
                    prompts = [[rng.randrange(32, 49152) for _ in range(args.prompt_len)] for _ in range(args.clients)]
                    compare_run(port, argparse.Namespace(**{**vars(args), "new_tokens": 2}), prompts, "none")  # warm-up
                    res = compare_run(port, args, prompts, loops)
                    rows.append((budget, mode, loops, res))
                    print(f"  budget {budget:5d} {mode:15s} loops {loops:6s} ITL p50 {res['itl_p50'] * 1e3:7.1f} ms "
                          f"p99 {res['itl_p99'] * 1e3:7.1f} ms, plain {res['tok_s']:7.1f} tok/s, "
                          f"{res['state_requests']} looping requests", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"\n{'budget':>6s} {'mode':15s} {'p99 ITL: states/none':>21s} {'states/plain loops':>19s} "
          f"{'plain tok/s: states/none':>25s} {'states/plain loops':>19s}")
    for budget in budgets:
        for mode in ("engine process", "in-process"):
            none, plain, on = (r for b, m, _, r in rows if m == mode and b == budget)
            print(f"{budget:6d} {mode:15s} {on['itl_p99'] / none['itl_p99']:20.2f}x "
                  f"{on['itl_p99'] / plain['itl_p99']:18.2f}x "
                  f"{on['tok_s'] / none['tok_s']:24.2f}x {on['tok_s'] / plain['tok_s']:18.2f}x")


def main(argv: list[str] | None = None) -> None:
    """Start the server, run the workloads, print the table."""
    args = parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    if args.compare_processes:
        compare_processes(args)
        return
    from tapllm.loader import resolve_model

    layers = json.loads((resolve_model(None) / "config.json").read_text())["num_hidden_layers"]
    states = {"layers": [1, layers // 2, layers - 1], "points": ["resid_pre"], "positions": "prompt"}
    rng = random.Random(0)

    def fresh_prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(32, 49152) for _ in range(args.prompt_len)] for _ in range(n)]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"tapllm serve, default model {args.dtype}: {args.clients} clients x {args.requests} streaming requests, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.rounds} round(s)", flush=True)
    proc = start_server(args, port)
    try:
        run_workload(url, fresh_prompts(args.clients), argparse.Namespace(**{**vars(args), "requests": 1,
                                                                             "new_tokens": 2}), "mixed", states)  # warm-up
        best: dict[str, dict] = {}
        names = ["plain", "states", "json", "mixed"]
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                res = run_workload(url, fresh_prompts(args.clients * args.requests), args, name, states)
                print(f"  round {r + 1} {name:6s} {res['req_s']:6.2f} req/s {res['tok_s']:7.1f} tok/s "
                      f"TTFT p50 {res['ttft_p50']:.2f} s p99 {res['ttft_p99']:.2f} s, {res['bytes'] / 1e6:.1f} MB",
                      flush=True)
                if name not in best or res["seconds"] < best[name]["seconds"]:
                    best[name] = res
        one = fresh_prompts(1)[0]
        b64 = response_bytes(url, one, {**states, "encoding": "base64"})
        lst = response_bytes(url, one, {**states, "encoding": "list"})
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    print(f"\n{'workload':8s} {'req/s':>7s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'received':>10s}")
    for name, res in best.items():
        print(f"{name:8s} {res['req_s']:7.2f} {res['tok_s']:8.1f} {res['ttft_p50']:8.2f}s {res['ttft_p99']:8.2f}s "
              f"{res['bytes'] / 1e6:8.1f} MB")
    for name, what in (("states", "hidden states (3 blocks x every prompt position, base64)"),
                       ("json", "structured output (JSON schema on every request)"),
                       ("mixed", "mixed (25% n=4, 25% JSON schema, 25% states, 25% plain)")):
        ratio = best[name]["tok_s"] / best["plain"]["tok_s"]
        ttft = best[name]["ttft_p50"] / best["plain"]["ttft_p50"]
        print(f"{what}: {ratio:.3f}x the plain throughput ({100 * (1 - ratio):.1f}% cost), TTFT p50 {ttft:.2f}x")
    print(f"one response: base64 {b64 / 1e6:.2f} MB, float lists {lst / 1e6:.2f} MB: lists are {lst / b64:.2f}x larger")


if __name__ == "__main__":
    main()
