"""Memory handed back: a ``tapllm serve``'s resident memory before, at the peak of, and after a burst of clients.

What it measures
    A real server (``tapllm serve``, default model, engine core in its own process) in a
    subprocess. Once it is healthy and has served one warm-up request, the resident set (VmRSS,
    with its anonymous / file / shared parts) of the API server process and of the engine core
    process is read: "before". Then ``--clients`` clients (default 64) each stream one request
    at once over raw HTTP: random-token prompts of ``--prompt-len`` tokens, ``--new-tokens``
    new tokens, greedy, EOS ignored; the requests cycle through four kinds (plain; hidden states
    of every block's ``resid_post`` at every position, base64; a JSON schema; ``n=4``
    sampling), so the KV cache, the capture buffers, the grammar matchers and the encoders all
    take memory. The RSS is sampled every 0.2 s during the burst ("peak"), and read again
    ``--settle`` seconds (default 30) after the last response ("after"). The target: the engine
    core's RSS after within 10% of before. Each of ``--rounds`` bursts repeats this on fresh
    prompts (no prefix-cache reuse), so memory kept from one burst to the next shows too.

How to run (from the repository root)
    python benchmarks/memory.py                      # 64 clients, prompt 256, 64 new tokens, 30 s
    python benchmarks/memory.py --clients 16 --settle 10 --rounds 1
    python benchmarks/memory.py --serve-args "--kv-cache-precommit"
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import REPO_ROOT, free_port, launch  # noqa: E402
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
KINDS = ("plain", "states", "json", "n4")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--settle", type=float, default=30.0, help="seconds after the burst before the last reading")
    p.add_argument("--rounds", type=int, default=2, help="bursts, each followed by --settle seconds")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"the request kinds the clients cycle through ({', '.join(KINDS)})")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--serve-args", default="", help="more arguments for tapllm serve (one string)")
    args = p.parse_args(argv)
    args.kinds = tuple(args.kinds.split(","))
    if not set(args.kinds) <= set(KINDS):
        p.error(f"--kinds: choose from {', '.join(KINDS)}")
    return args


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def rss(pid: int) -> dict[str, float]:
    """VmRSS and its RssAnon / RssFile / RssShmem parts, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) / 1024
    return out


def processes(server: int) -> dict[str, int]:
    """``{"api server": pid, "engine core": pid}`` (the core is the server's spawned child; the other
    Python child is multiprocessing's resource tracker)."""
    cores = [p for p in children(server) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    if not cores:
        raise RuntimeError("no engine core process under the server")
    return {"api server": server, "engine core": cores[0]}


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = ["--dtype", args.dtype, "--quiet",
           "--enable-hidden-states", "--hidden-states-max-bytes", str(1 << 30), "--served-model-name", "default",
           "--max-num-seqs", str(max(16, args.clients * 4)), *shlex.split(args.serve_args)]
    return launch(cmd, port)


def body(kind: str, prompt: list[int], new: int, index: int) -> dict:
    b: dict = {"model": "default", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
               "stream": True}
    if kind == "states":
        b["hidden_states"] = {"layers": "all", "points": ["resid_post"], "positions": "all", "encoding": "base64"}
    elif kind == "json":
        b.update(ignore_eos=False, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "p", "schema": SCHEMA}})
    elif kind == "n4":
        b.update(n=4, temperature=1.0, seed=index)
    return b


def stream(port: int, request: dict) -> int:
    """Send one streaming request; the bytes received."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/completions", json.dumps(request), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
    return len(data)


def burst(port: int, prompts: list[list[int]], new: int, pids: dict[str, int], kinds: tuple[str, ...] = KINDS
          ) -> tuple[dict[str, float], float, int]:
    """All clients at once; (peak VmRSS per process during it, seconds, bytes received)."""
    peak = {name: rss(pid)["VmRSS"] for name, pid in pids.items()}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            for name, pid in pids.items():
                peak[name] = max(peak[name], rss(pid)["VmRSS"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        received = sum(pool.map(lambda i: stream(port, body(kinds[i % len(kinds)], prompts[i], new, i)),
                                range(len(prompts))))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return peak, seconds, received


def main(argv: list[str] | None = None) -> int:
    """Run the bursts, print the readings; exit status 1 when the engine core misses the 10% target."""
    args = parse_args(argv)
    rng = random.Random(0)
    port = free_port()
    print(f"tapllm serve, default model {args.dtype}: {args.rounds} burst(s) of {args.clients} streaming clients "
          f"(kinds {', '.join(args.kinds)} in turn), prompt {args.prompt_len}, {args.new_tokens} new tokens; "
          f"readings {args.settle:.0f} s after each burst", flush=True)
    proc = start_server(args, port)
    ok = True
    try:
        pids = processes(proc.pid)
        stream(port, body("plain", [rng.randrange(32, 49152) for _ in range(8)], 2, 0))  # warm-up
        time.sleep(2)
        before = {name: rss(pid) for name, pid in pids.items()}
        for name, r in before.items():
            print(f"  before        {name:11s} RSS {r['VmRSS']:7.0f} MiB (anon {r['RssAnon']:6.0f}, "
                  f"file {r['RssFile']:5.0f}, shmem {r['RssShmem']:5.0f})", flush=True)
        for round_ in range(args.rounds):
            prompts = [[rng.randrange(32, 49152) for _ in range(args.prompt_len)] for _ in range(args.clients)]
            peak, seconds, received = burst(port, prompts, args.new_tokens, pids, args.kinds)
            print(f"  burst {round_ + 1}: {args.clients} requests in {seconds:.1f} s, {received / 1e6:.1f} MB received",
                  flush=True)
            time.sleep(args.settle)
            after = {name: rss(pid) for name, pid in pids.items()}
            for name in pids:
                b, a = before[name]["VmRSS"], after[name]["VmRSS"]
                print(f"  burst {round_ + 1} {name:11s} RSS before {b:7.0f} MiB, peak {peak[name]:7.0f} MiB, "
                      f"{args.settle:.0f} s after {a:7.0f} MiB ({100 * (a / b - 1):+.1f}%; anon "
                      f"{after[name]['RssAnon']:.0f}, file {after[name]['RssFile']:.0f}, "
                      f"shmem {after[name]['RssShmem']:.0f})", flush=True)
            total_b = sum(r["VmRSS"] for r in before.values())
            total_a = sum(r["VmRSS"] for r in after.values())
            print(f"  burst {round_ + 1} both processes: {total_b:.0f} -> {total_a:.0f} MiB "
                  f"({100 * (total_a / total_b - 1):+.1f}%)", flush=True)
            core_ok = after["engine core"]["VmRSS"] <= 1.1 * before["engine core"]["VmRSS"]
            ok = ok and core_ok
            print(f"  burst {round_ + 1}: engine core within 10% of before: {'yes' if core_ok else 'NO'}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
