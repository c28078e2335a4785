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
    ``--settle`` seconds (default 30) after the last response ("after"). The target: the
    process tree's RSS after (the API server, the engine core and multiprocessing's resource
    tracker) at most 1.10x before, and each of the two main processes within 10% of its own
    before. Each of ``--rounds`` bursts repeats this on fresh prompts (no prefix-cache reuse),
    so memory kept from one burst to the next shows too. Exit status 1 when a target is missed.

Each request alone (``--check-alone``)
    The server is started with ``--enable-steering`` too, and the burst also holds steered
    greedy requests: ``steered`` (an ``add`` at two blocks' ``resid_post`` and an ``ablate`` at
    a third) and ``steered-states`` (the same, with the states of ``states``). Every greedy
    request of the burst (``plain``, ``states``, ``json``, ``steered``, ``steered-states``) asks
    for its tokens' logprobs; after the burst's reading each is sent again alone, one after
    another, to the same server (which has forgotten the burst's cached prefixes by then: the
    engine's idle release, 10 s after its last step by default: a ``--settle`` shorter than the
    server's ``--release-memory-after-idle`` lets the replays reuse them), and its tokens,
    logprobs and states (where asked) are compared bitwise with the burst's. Mismatches are
    counted apart for steered and unsteered requests.
    Targets (issue 50): in the default mode, steered token mismatches no more frequent than
    unsteered ones; with ``--serve-args=--batch-invariant``, none at all.

How to run (from the repository root)
    python benchmarks/memory.py                      # 64 clients, prompt 256, 64 new tokens, 30 s
    python benchmarks/memory.py --clients 16 --settle 10 --rounds 1
    python benchmarks/memory.py --serve-args "--kv-cache-precommit"
    python benchmarks/memory.py --rounds 1 --check-alone
    python benchmarks/memory.py --rounds 1 --check-alone --serve-args=--batch-invariant
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import REPO_ROOT, free_port, launch  # noqa: E402
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
KINDS = ("plain", "states", "json", "n4")
STEERED_KINDS = ("steered", "steered-states")
ALL_KINDS = KINDS + STEERED_KINDS
CHECKED = ("plain", "states", "json", *STEERED_KINDS)  # the greedy kinds compared with themselves alone
TARGET = 1.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--settle", type=float, default=30.0, help="seconds after the burst before the last reading")
    p.add_argument("--rounds", type=int, default=2, help="bursts, each followed by --settle seconds")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"the request kinds the clients cycle through ({', '.join(ALL_KINDS)}; the steered ones "
                        "come with --check-alone)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--serve-args", default="", help="more arguments for tapllm serve (one string)")
    p.add_argument("--check-alone", action="store_true",
                   help="add steered greedy requests to the burst (the server gets --enable-steering), then send "
                        "every greedy request again alone and count mismatches, steered and unsteered apart")
    args = p.parse_args(argv)
    args.kinds = tuple(args.kinds.split(","))
    if not set(args.kinds) <= set(ALL_KINDS):
        p.error(f"--kinds: choose from {', '.join(ALL_KINDS)}")
    if args.check_alone:
        args.kinds = (*args.kinds, *(k for k in STEERED_KINDS if k not in args.kinds))
    elif set(args.kinds) & set(STEERED_KINDS):
        p.error("--kinds: the steered kinds need --check-alone (the server must enable steering)")
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


def regions(pid: int) -> dict[str, float]:
    """Where ``pid``'s resident memory lies, from /proc/PID/smaps, in MiB: ``heap`` (glibc's main arena),
    ``anon`` (other anonymous mappings: thread arenas, large ``mmap`` blocks, Python's object arenas,
    torch's buffers), ``stack`` and ``file`` (mapped files: libraries, the weights)."""
    out = {"heap": 0.0, "anon": 0.0, "stack": 0.0, "file": 0.0}
    where = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=6)
        if "-" in head[0] and len(head) >= 5:  # a mapping's header: address range, perms, offset, dev, inode [, path]
            path = head[5] if len(head) > 5 else ""
            where = "heap" if path == "[heap]" else "stack" if path.startswith("[stack") else \
                "file" if path.startswith("/") else "anon"
        elif head[0] == "Rss:":
            out[where] += int(head[1]) / 1024
    return out


def descendants(pid: int) -> list[int]:
    """``pid``'s children, their children, and so on."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def tree_rss(server: int) -> float:
    """VmRSS of ``server`` and all its descendants, in MiB (a process that ends meanwhile counts 0)."""
    total = 0.0
    for pid in (server, *descendants(server)):
        try:
            total += rss(pid)["VmRSS"]
        except (OSError, KeyError):  # gone, or a zombie (no VmRSS)
            pass
    return total


def regions_text(pid: int) -> str:
    """:func:`regions` as text."""
    return ", ".join(f"{k} {v:.0f}" for k, v in regions(pid).items())


def processes(server: int) -> dict[str, int]:
    """``{"api server": pid, "engine core": pid}`` (the core is the server's spawned child; the other
    Python child is multiprocessing's resource tracker)."""
    cores = [p for p in children(server) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    if not cores:
        raise RuntimeError("no engine core process under the server")
    return {"api server": server, "engine core": cores[0]}


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """``tapllm serve`` on the default model (with steering for ``--check-alone``), once healthy."""
    cmd = ["--dtype", args.dtype, "--quiet",
           "--enable-hidden-states", "--hidden-states-max-bytes", str(1 << 30), "--served-model-name", "default",
           "--max-num-seqs", str(max(16, args.clients * 4)), *(["--enable-steering"] if args.check_alone else []),
           *shlex.split(args.serve_args)]
    return launch(cmd, port)


def steering(hidden: int, layers: int) -> list[dict[str, Any]]:
    """The steers of a steered request: ``add`` of a random unit direction (x 8) to ``resid_post`` at
    a third and at half of the blocks, and ``ablate`` of another at two thirds."""
    rng = random.Random(1)

    def unit() -> list[float]:
        v = [rng.gauss(0.0, 1.0) for _ in range(hidden)]
        norm = sum(x * x for x in v) ** 0.5
        return [x / norm for x in v]

    return [{"layers": [layers // 3, layers // 2], "point": "resid_post", "op": "add", "vector": unit(), "scale": 8.0},
            {"layers": [2 * layers // 3], "point": "resid_post", "op": "ablate", "vector": unit()}]


def body(kind: str, prompt: list[int], new: int, index: int, steers: list[dict[str, Any]] | None = None,
         logprobs: bool = False) -> dict:
    """The request of ``kind`` (see the module docstring); with ``logprobs`` it asks for its tokens' logprobs."""
    b: dict = {"model": "default", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
               "stream": True}
    if kind in ("states", "steered-states"):
        b["hidden_states"] = {"layers": "all", "points": ["resid_post"], "positions": "all", "encoding": "base64"}
    if kind in STEERED_KINDS:
        if steers is None:
            raise ValueError(f"a {kind} request needs the steers")
        b["steering"] = steers
    if kind == "json":
        b.update(ignore_eos=False, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "p", "schema": SCHEMA}})
    elif kind == "n4":
        b.update(n=4, temperature=1.0, seed=index)
    if logprobs:
        b["logprobs"] = 0
    return b


@dataclass
class Reply:
    """What one streamed single-choice completion returned."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    states: Any = None
    size: int = 0


def stream(port: int, request: dict, keep: bool = False) -> Reply:
    """Send one streaming request; its bytes received, and with ``keep`` its text, tokens, logprobs and states
    (one choice)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/completions", json.dumps(request), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
    reply = Reply(size=len(data))
    if not keep:
        return reply
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        for c in chunk.get("choices", ()):
            reply.text += c.get("text", "")
            if c.get("logprobs"):
                reply.tokens += c["logprobs"]["tokens"]
                reply.logprobs += c["logprobs"]["token_logprobs"]
            if c.get("hidden_states") is not None:
                reply.states = c["hidden_states"]
    return reply


def burst(port: int, requests: list[dict], pids: dict[str, int], keep: list[bool]
          ) -> tuple[dict[str, float], float, int, list[Reply]]:
    """All clients at once; (peak VmRSS per process during it, seconds, bytes received, the replies)."""
    peak = {name: rss(pid)["VmRSS"] for name, pid in pids.items()}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            for name, pid in pids.items():
                peak[name] = max(peak[name], rss(pid)["VmRSS"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        replies = list(pool.map(lambda i: stream(port, requests[i], keep[i]), range(len(requests))))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return peak, seconds, sum(r.size for r in replies), replies


@dataclass
class Mismatches:
    """Greedy requests of one group (steered or unsteered) against themselves alone."""

    requests: int = 0
    tokens: int = 0  # requests whose tokens differ
    same_tokens: int = 0
    logprobs: int = 0  # of the requests with the same tokens, those whose logprobs differ
    same_tokens_states: int = 0  # of the requests with the same tokens, those that asked for states
    states: int = 0  # of those, the ones whose states differ
    first_diffs: list[int] = field(default_factory=list)  # the generated token where each mismatch begins

    def add(self, batched: Reply, alone: Reply) -> None:
        """Count one request."""
        self.requests += 1
        if batched.tokens != alone.tokens or batched.text != alone.text:
            self.tokens += 1
            self.first_diffs.append(next((i for i, (a, b) in enumerate(zip(batched.tokens, alone.tokens)) if a != b),
                                         min(len(batched.tokens), len(alone.tokens))))
            return
        self.same_tokens += 1
        self.logprobs += batched.logprobs != alone.logprobs
        if batched.states is not None:
            self.same_tokens_states += 1
            self.states += batched.states != alone.states

    def line(self) -> str:
        """One line of the report."""
        where = f" (from generated token {', '.join(map(str, sorted(self.first_diffs)))})" if self.first_diffs else ""
        return (f"tokens differ in {self.tokens}/{self.requests}{where}; with the same tokens, logprobs differ in "
                f"{self.logprobs}/{self.same_tokens}, states in {self.states}/{self.same_tokens_states}")


def check_alone(port: int, requests: list[dict], replies: list[Reply], kinds: list[str]
                ) -> dict[str, Mismatches]:
    """Send each checked request again alone, one after another; mismatches, steered and unsteered apart."""
    counts = {"unsteered": Mismatches(), "steered": Mismatches()}
    for request, batched, kind in zip(requests, replies, kinds, strict=True):
        if kind not in CHECKED:
            continue
        alone = stream(port, request, keep=True)
        counts["steered" if kind in STEERED_KINDS else "unsteered"].add(batched, alone)
    return counts


def model_shape() -> tuple[int, int]:
    """The default model's (hidden size, blocks)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tapllm.loader import resolve_model

    config = json.loads((resolve_model(None) / "config.json").read_text())
    return config["hidden_size"], config["num_hidden_layers"]


def main(argv: list[str] | None = None) -> int:
    """Run the bursts, print the readings; exit status 1 when a memory target is missed or, with
    ``--check-alone``, a request differs from itself alone under ``--batch-invariant``."""
    args = parse_args(argv)
    rng = random.Random(0)
    port = free_port()
    steers = steering(*model_shape()) if args.check_alone else None
    invariant = "--batch-invariant" in shlex.split(args.serve_args)
    extra = f", --serve-args {args.serve_args!r}" if args.serve_args else ""
    print(f"tapllm serve, default model {args.dtype}{extra}: "
          f"{args.rounds} burst(s) of {args.clients} streaming clients (kinds {', '.join(args.kinds)} in turn), "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens; readings {args.settle:.0f} s after each burst",
          flush=True)
    proc = start_server(args, port)
    ok = True
    try:
        pids = processes(proc.pid)
        stream(port, body("plain", [rng.randrange(32, 49152) for _ in range(8)], 2, 0))  # warm-up
        time.sleep(2)
        before = {name: rss(pid) for name, pid in pids.items()}
        tree_before = tree_rss(proc.pid)
        for name, r in before.items():
            print(f"  before        {name:11s} RSS {r['VmRSS']:7.0f} MiB (anon {r['RssAnon']:6.0f}, "
                  f"file {r['RssFile']:5.0f}, shmem {r['RssShmem']:5.0f}; {regions_text(pids[name])})", flush=True)
        print(f"  before        process tree RSS {tree_before:7.0f} MiB", flush=True)
        for round_ in range(args.rounds):
            kinds = [args.kinds[i % len(args.kinds)] for i in range(args.clients)]
            keep = [args.check_alone and kind in CHECKED for kind in kinds]
            requests = [body(kind, [rng.randrange(32, 49152) for _ in range(args.prompt_len)], args.new_tokens, i,
                             steers, keep[i]) for i, kind in enumerate(kinds)]
            peak, seconds, received, replies = burst(port, requests, pids, keep)
            print(f"  burst {round_ + 1}: {args.clients} requests in {seconds:.1f} s, {received / 1e6:.1f} MB received",
                  flush=True)
            time.sleep(args.settle)
            after = {name: rss(pid) for name, pid in pids.items()}
            tree_after = tree_rss(proc.pid)
            for name in pids:
                b, a = before[name]["VmRSS"], after[name]["VmRSS"]
                within = a <= TARGET * b
                ok = ok and within
                print(f"  burst {round_ + 1} {name:11s} RSS before {b:7.0f} MiB, peak {peak[name]:7.0f} MiB, "
                      f"{args.settle:.0f} s after {a:7.0f} MiB ({100 * (a / b - 1):+.1f}%; anon "
                      f"{after[name]['RssAnon']:.0f}, file {after[name]['RssFile']:.0f}, "
                      f"shmem {after[name]['RssShmem']:.0f}; {regions_text(pids[name])}): within 10% "
                      f"{'yes' if within else 'NO'}", flush=True)
            ratio = tree_after / tree_before
            ok = ok and ratio <= TARGET
            print(f"  burst {round_ + 1} process tree: {tree_before:.0f} -> {tree_after:.0f} MiB, after/before "
                  f"{ratio:.3f}x: <= {TARGET:.2f}x {'yes' if ratio <= TARGET else 'NO'}", flush=True)
            if args.check_alone:
                t0 = time.perf_counter()
                counts = check_alone(port, requests, replies, kinds)
                print(f"  burst {round_ + 1} each greedy request alone ({time.perf_counter() - t0:.0f} s):", flush=True)
                for group, m in counts.items():
                    print(f"    {group:9s} {m.line()}", flush=True)
                steered, unsteered = counts["steered"], counts["unsteered"]
                if invariant:
                    same = steered.tokens + unsteered.tokens + steered.logprobs + unsteered.logprobs + \
                        steered.states + unsteered.states == 0
                    ok = ok and same
                    print(f"    --batch-invariant: every request bitwise itself alone: {'yes' if same else 'NO'}",
                          flush=True)
                else:
                    # a rate: the two groups need not hold the same number of requests
                    fewer = steered.tokens * max(1, unsteered.requests) <= unsteered.tokens * max(1, steered.requests)
                    ok = ok and fewer
                    print(f"    steered token mismatches no more frequent than unsteered: {'yes' if fewer else 'NO'}",
                          flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
