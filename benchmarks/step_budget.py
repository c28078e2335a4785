"""What a CUDA step costs, counted on the CPU: kernels per block, host ops and host time per step, and
how a serving trace runs through the graphs. Deterministic counts, whatever the machine's noise.

The CUDA backend's modules run here on CPU tensors with Triton's interpreter (``TRITON_INTERPRET=1``,
set by this script before anything imports triton) and CUDA graphs are emulated: the graph runner calls
the very function a graph holds, on the same static buffers (``capture=False``), so every op a replay
would launch and every op the host issues around it can be counted.

What it prints (and writes with ``--json FILE``)
    kernels_per_block   kernels one block of a replayed decode graph launches (bf16, a 16-block Llama):
                        aten ops that would run a kernel (not views, not allocations, a cast only when
                        it converts) plus Triton launches, while that block runs; ``per_step`` the rest,
                        but for ``draw``: the random draw a greedy step's graph skips (a conditional node).
                        ``kernels_tapped``: the same for the tapped graph (every request captures the
                        last position's ``final`` state; which taps does not change the graph).
    host_ops[case][b]   aten ops outside the graph body in one decode step of ``b`` requests (the same
                        counting rule), for a plain step and tapped ones: the last position's ``final``
                        state; 3 blocks x every position; every block x every position; half the batch
                        steered (add at 3 blocks, ablate at one); an SAE's top-16 features at one block.
    host_ms[case][b]    the step's wall time minus the time inside the graph body (the replay), in the SAE
                        encoder that runs after it and in the copy of the captured rows to the host (device
                        work on a GPU: kernels and an asynchronous copy), the fastest of ``--timed-steps``
                        decode steps (another job on the machine only ever slows a step), nothing counting;
                        the host's share of a step on a GPU. The body and the encoder stand in as a replay
                        does for the host: their first outputs, at once (interpreting them every step would
                        leave the host code after them with cold caches: ``host_ms_interpreted``, with
                        ``--interpreted-timing``).
    trace               a serving trace through the graph path (``--trace-requests``): requests arriving
                        over time with mixed taps and steers; captures after warm-up, distinct graphs,
                        buckets, the share of eager steps and why, and whether tokens and states equal
                        the eager path's.

How to run
    python benchmarks/step_budget.py --json step_budget.json
    python benchmarks/step_budget.py --batches 1,16 --skip-trace      # quicker
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VOCAB = 49152
# Ops that launch nothing on a GPU: allocations and aliases.
_NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::alias",
              "aten::lift_fresh", "aten::set_", "aten::resize_"}
# Ops that read a device value on the host: each is a sync, reported apart.
_SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique"}


class OpCount(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel, by phase (``phase`` is set from outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "host"
        self.ops: dict[str, list[str]] = {}
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in _SYNCS:
            self.syncs.append(name)
        if name in _NO_KERNEL or name in _SYNCS:
            return out
        if func.is_view and not _copied(args, out):
            return out
        self.ops.setdefault(self.phase, []).append(name)
        return out


def _copied(args: tuple, out: Any) -> bool:
    """True when a view-capable op (``to``, ``reshape``, ``contiguous``) made new storage."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


class TritonCount:
    """Counts Triton launches (``kernel[grid](...)``) of the given modules' kernels, by the op counter's phase;
    the interpreter's own tensor work is hidden from the op counter."""

    def __init__(self, modules: list[Any]) -> None:
        self.launches: dict[str, list[str]] = {}
        self.counter: OpCount | None = None
        self._undo: list[tuple[Any, str, Any]] = []
        for mod in modules:
            for name in dir(mod):
                k = getattr(mod, name)
                if name.endswith("_kernel") and type(k).__name__ in ("InterpretedFunction", "JITFunction"):
                    self._undo.append((mod, name, k))
                    setattr(mod, name, _Launch(self, name, k))

    def restore(self) -> None:
        for mod, name, k in self._undo:
            setattr(mod, name, k)


class _Launch:
    def __init__(self, owner: TritonCount, name: str, kernel: Any) -> None:
        self.owner, self.name, self.kernel = owner, name, kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            c = self.owner.counter
            if c is not None:
                self.owner.launches.setdefault(c.phase, []).append(self.name)
            with _disable_current_modes():
                return launch(*args, **kwargs)
        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


# ---- the model ----------------------------------------------------------------------------------
def model_folder(root: Path, layers: int) -> Path:
    """A Llama of ``layers`` blocks with small widths (random weights: ``load_format="dummy"``) and the
    default tokenizer."""
    from transformers import LlamaConfig

    from tapllm.loader import resolve_model

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, intermediate_size=512, tie_word_embeddings=True,
                      max_position_embeddings=2048, rms_norm_eps=1e-5)
    cfg.architectures = ["LlamaForCausalLM"]
    folder = root / f"llama{layers}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    for f in resolve_model(None).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens")):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def cuda_llm(folder: Path, dtype: str, max_seqs: int, **kw: Any) -> Any:
    """An engine on the CUDA backend, run on the CPU (see the module docstring)."""
    from tapllm import LLM

    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64) if b <= max_seqs]
    kw.setdefault("cuda_graph_token_sizes", [])
    return LLM(folder, dtype=dtype, load_format="dummy", max_num_seqs=max_seqs, max_model_len=1024,
               enable_prefix_caching=False, backend="cuda", cuda_graph_sizes=sizes, **kw)


def graph_body(runner: Any) -> tuple[Any, str]:
    """The object and method name of the function a graph holds (hooked to tell body from host)."""
    return runner.graph_step.graphs, "body"


# ---- the cases ----------------------------------------------------------------------------------
def cases(hidden: int, layers: int) -> dict[str, Callable[[int], Any]]:
    from tapllm import HiddenStatesSpec, SamplingParams, Steer
    from tapllm.sae.model import SAE
    from tapllm.sae.sae_config import SAEConfig

    g = torch.Generator().manual_seed(0)
    direction = torch.randn(hidden, generator=g)
    three = sorted({0, layers // 2, layers - 1})  # three blocks where the model has them
    d_sae = 16 * hidden
    sae = SAE(SAEConfig("topk", hidden, d_sae, point="resid_post", layer=layers // 2, k=64),
              torch.randn(hidden, d_sae, generator=g) / hidden**0.5, torch.zeros(d_sae),
              torch.randn(d_sae, hidden, generator=g) / d_sae**0.5, torch.zeros(hidden))

    def params(**kw: Any) -> Any:
        return SamplingParams(max_tokens=256, temperature=0, ignore_eos=True, **kw)

    steers = [Steer(layers=three, point="resid_post", vector=direction, scale=2.0),
              Steer(layers=[layers // 3], point="resid_post", op="ablate", vector=direction)]
    return {
        "plain": lambda i: params(),
        "last": lambda i: params(hidden_states=HiddenStatesSpec(points="final", positions="last")),
        "3_blocks_all": lambda i: params(hidden_states=HiddenStatesSpec(layers=three, points="resid_post",
                                                                        positions="all")),
        "every_block_all": lambda i: params(hidden_states=HiddenStatesSpec(layers="all", points="resid_post",
                                                                           positions="all")),
        "half_steered": lambda i: params(steering=steers if i % 2 == 0 else None),
        "sae_top16": lambda i: params(hidden_states=HiddenStatesSpec(sae=sae, features="topk:16", positions="all")),
    }


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def decode_steps(llm: Any, make: Callable[[int], Any], batch: int, seed: int, prompt_len: int, warm: int = 2
                 ) -> Any:
    """Add ``batch`` requests, run their prompts and ``warm`` decode steps; returns the engine, ready to
    schedule a pure decode step of ``batch`` rows."""
    engine = llm.engine
    for i, p in enumerate(_prompts(batch, prompt_len, seed)):
        engine.add(engine.input_processor.prepare(p, make(i), request_id=f"r{seed}-{i}"))
    with cpu_prefill(engine.runner):  # not measured: the interpreter would take minutes over the prompts
        while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()
    for _ in range(warm):
        engine.step()
    return engine


class cpu_prefill:
    """Run the prompts on the eager step (the same KV cache layout), then hand the steps back."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def __enter__(self) -> None:
        from tapllm.backends.select import select_backend

        self.saved = self.runner.backend, self.runner.graph_step
        self.runner.backend = select_backend(torch.device("cpu"), self.runner.mcfg.dtype, enforce_eager=True)
        self.runner.graph_step = None
        self.runner.model.use_backend(self.runner.backend)

    def __exit__(self, *exc: Any) -> None:
        self.runner.backend, self.runner.graph_step = self.saved
        self.runner.model.use_backend(self.runner.backend)


def finish(engine: Any, seed: int, batch: int) -> None:
    for i in range(batch):
        engine.abort(f"r{seed}-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def measure_step(llm: Any, make: Callable[[int], Any], batch: int, seed: int, args: argparse.Namespace
                 ) -> dict[str, Any]:
    """Host ops (counted) of one decode step, then host ms (timed, nothing counting) over more steps."""
    engine = decode_steps(llm, make, batch, seed, args.prompt_len)
    runner = engine.runner
    owner, name = graph_body(runner)
    body = getattr(owner, name)
    counter = OpCount()
    TRITON.counter = counter
    inside = {"s": 0.0, "calls": 0}

    def hooked(*a: Any, **kw: Any) -> Any:
        prev = counter.phase
        counter.phase = "body"
        t0 = time.perf_counter()
        try:
            return body(*a, **kw)
        finally:
            inside["s"] += time.perf_counter() - t0
            inside["calls"] += 1
            counter.phase = prev

    # The SAE encoder runs after the replay (a matmul and a Triton kernel: device work on a GPU, issued
    # without a sync); its time is the device's, not the host's, so it is kept out of host_ms too. The host
    # work around it (gathering the rows, the pack's layout, handing each request its row) is measured.
    from tapllm.engine import graph_decode, graph_step
    from tapllm.sae import batch as sae_batch

    pack = sae_batch.group_pack

    def pack_timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return pack(*a, **kw)
        finally:
            inside["s"] += time.perf_counter() - t0

    # The copy of the step's captured rows to the host is the same: an asynchronous copy on a GPU (host
    # time: its launch), a clone of the capture buffer here.
    to_host = graph_step._to_host

    def to_host_timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return to_host(*a, **kw)
        finally:
            inside["s"] += time.perf_counter() - t0

    setattr(owner, name, hooked)
    sae_batch.group_pack = graph_decode.group_pack = pack_timed
    graph_step._to_host = to_host_timed
    try:
        sched = engine.scheduler.schedule()
        assert all(it.num_tokens == 1 for it in sched.items) and len(sched.items) == batch
        TRITON.launches.clear()
        with counter:
            engine.runner.execute(sched.items)
        host_ops = counter.ops.get("host", [])
        host_launches = TRITON.launches.get("host", [])
        body_calls = inside["calls"]
        TRITON.counter = None
        times = timed_steps(engine, args.timed_steps, inside, owner, name, hooked)
        interpreted = None
        if args.interpreted_timing:
            interpreted = timed_steps(engine, args.timed_steps, inside, owner, name, hooked,
                                      stand_in=False)
    finally:
        setattr(owner, name, body)
        sae_batch.group_pack = graph_decode.group_pack = pack
        graph_step._to_host = to_host
        TRITON.counter = None
    finish(engine, seed, batch)
    return {"host_ops": len(host_ops) + len(host_launches), "ops": dict(Counter(host_ops + host_launches)),
            "syncs": list(counter.syncs), "graph_replays": body_calls, "host_ms": round(min(times), 4),
            "host_ms_interpreted": round(min(interpreted), 4) if interpreted else None}


def timed_steps(engine: Any, steps: int, inside: dict[str, Any], owner: Any, name: str, hooked: Callable,
                stand_in: bool = True) -> list[float]:
    """Host ms of ``steps`` decode steps: wall time minus the time ``inside`` the graph body, the SAE
    encoder and the host copy.

    ``stand_in``: the graph body and the SAE encoder's device work (:func:`tapllm.sae.batch.group_pack`)
    return their first outputs again (per graph; per SAE and number of rows) as a replay does for the
    host, which only launches it. Interpreted Triton takes milliseconds and leaves the CPU's caches cold
    for the host code after it, a cost no GPU step has; with ``stand_in=False`` they run every step
    (``--interpreted-timing``)."""
    from tapllm.engine import graph_decode, graph_step
    from tapllm.sae import batch as sae_batch

    pack = sae_batch.group_pack
    bodies: dict[Any, Any] = {}
    packs: dict[tuple[int, int], Any] = {}

    def replay(key: Any) -> Any:
        if key not in bodies:
            bodies[key] = hooked(key)
        return bodies[key]

    def packed(sae: Any, sels: Any, x: Any, *a: Any, **kw: Any) -> Any:
        key = (id(sae), x.shape[0])
        if key not in packs:
            packs[key] = pack(sae, sels, x, *a, **kw)
        return packs[key]

    # The step's host copy of the captured rows is a DMA into pinned memory on a GPU; here the CPU writes
    # it, and into fresh memory each step, whose page faults and cache misses land on the host code
    # after it. As a stand-in it goes to one reused buffer (its time is excluded either way; the timed
    # steps' rows are never read).
    to_host = graph_step._to_host
    reused: dict[torch.dtype, torch.Tensor] = {}

    def to_reused(t: Any, sink: Any) -> Any:
        t0 = time.perf_counter()
        buf = reused.get(t.dtype)
        if buf is None or buf.numel() < t.numel():
            buf = reused[t.dtype] = torch.empty(2 * t.numel(), dtype=t.dtype)
        out = buf[: t.numel()].view(t.shape).copy_(t)
        inside["s"] += time.perf_counter() - t0
        return out

    if stand_in:
        setattr(owner, name, replay)
        sae_batch.group_pack = graph_decode.group_pack = packed
        graph_step._to_host = to_reused
    times = []
    try:
        for _ in range(steps):
            inside["s"] = 0.0
            sched = engine.scheduler.schedule()
            t0 = time.perf_counter()
            result = engine.runner.execute(sched.items)
            total = time.perf_counter() - t0
            times.append((total - inside["s"]) * 1e3)
            _advance(engine, sched, result)
    finally:
        setattr(owner, name, hooked)
        sae_batch.group_pack = graph_decode.group_pack = pack
        graph_step._to_host = to_host
    return times


def _advance(engine: Any, sched: Any, result: Any) -> None:
    """What ``LLMEngine.step`` does after ``execute``: the requests take their tokens."""
    for it in sched.items:
        it.request.num_computed_tokens += it.num_tokens
    for req, token in result.sampled.items():
        engine.output_processor.append_token(req, token)


def kernels_per_block(llm: Any, args: argparse.Namespace, case: str = "plain") -> dict[str, Any]:
    """Kernels each block of one decode graph body launches (batch 16; ``case``'s requests: the plain
    graph, or the tapped one), and the step's others."""
    engine = decode_steps(llm, cases(256, args.layers)[case], 16, 7, args.prompt_len)
    runner = engine.runner
    counter = OpCount()
    counter.phase = "outside"
    TRITON.counter = counter
    TRITON.launches.clear()
    layers = runner.model.layers
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "phase", f"block{i}")))
        hooks.append(layer.register_forward_hook(lambda m, a, o: setattr(counter, "phase", "per_step")))
    owner, name = graph_body(runner)
    body = getattr(owner, name)

    def hooked(*a: Any, **kw: Any) -> Any:
        counter.phase = "per_step"
        try:
            return body(*a, **kw)
        finally:
            counter.phase = "outside"

    # The draw of rows sampling at random sits in a conditional node a greedy step skips on a GPU (the
    # emulation runs it every step): its kernels are counted apart.
    draw_body = owner.draw_body

    def hooked_draw(*a: Any, **kw: Any) -> Any:
        prev, counter.phase = counter.phase, "draw"
        try:
            return draw_body(*a, **kw)
        finally:
            counter.phase = prev

    setattr(owner, name, hooked)
    owner.draw_body = hooked_draw
    try:
        sched = engine.scheduler.schedule()
        with counter:
            runner.execute(sched.items)
    finally:
        setattr(owner, name, body)
        del owner.draw_body
        for h in hooks:
            h.remove()
        TRITON.counter = None
    finish(engine, 7, 16)
    per_block = []
    kinds: Counter[str] = Counter()
    for i in range(len(layers)):
        ops = counter.ops.get(f"block{i}", []) + TRITON.launches.get(f"block{i}", [])
        per_block.append(len(ops))
        kinds.update(ops)
    per_step = counter.ops.get("per_step", []) + TRITON.launches.get("per_step", [])
    draw = counter.ops.get("draw", []) + TRITON.launches.get("draw", [])
    return {"kernels_per_block": round(statistics.mean(per_block), 2) if per_block else None,
            "per_block": per_block, "block_kernels": {k: round(v / len(layers), 2) for k, v in kinds.items()},
            "per_step_kernels": len(per_step), "per_step": dict(Counter(per_step)),
            "draw_kernels": len(draw), "draw": dict(Counter(draw))}


# ---- the serving trace ------------------------------------------------------------------------
# What the trace's requests ask for, and how often (weights). Attention patterns and SAE feature
# edits are left out: they run eagerly by design (docs/gpu.md says why).
TRACE_KINDS = {"plain": 8, "capture": 6, "steer": 4, "both": 2, "sampled": 2, "logprobs": 1}


def trace_requests(n: int, hidden: int, layers: int, seed: int) -> list[tuple[int, list[int], Any]]:
    """``n`` requests as (arrival step, prompt, params): Poisson arrivals (about 2 a step), mixed taps and steers."""
    import random

    from tapllm import HiddenStatesSpec, SamplingParams, Steer
    from tapllm.sae.model import SAE
    from tapllm.sae.sae_config import SAEConfig

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sae = SAE(SAEConfig("topk", hidden, 4 * hidden, point="resid_post", layer=layers - 1, k=8),
              torch.randn(hidden, 4 * hidden, generator=g) / hidden**0.5, torch.zeros(4 * hidden),
              torch.randn(4 * hidden, hidden, generator=g) / hidden**0.5, torch.zeros(hidden))
    vectors = [torch.randn(hidden, generator=g) for _ in range(4)]

    def spec() -> Any:
        pick = rng.randrange(9)
        some = sorted(rng.sample(range(layers), rng.randint(1, layers)))
        return [HiddenStatesSpec(points="final", positions="last"),
                HiddenStatesSpec(layers=some, points="resid_post", positions="all"),
                HiddenStatesSpec(layers="all", points=["resid_pre", "attn_out"], positions="generated"),
                HiddenStatesSpec(layers=some, points="resid_mid", positions="prompt", reduce="mean"),
                HiddenStatesSpec(layers=some, points=["q", "mlp_post"], positions=(1, 6)),
                HiddenStatesSpec(layers=[0], points=["k", "v", "z"], positions="last_prompt"),
                HiddenStatesSpec(sae=sae, features="topk:4", positions="all"),
                HiddenStatesSpec(layers="all", points="mlp_out", positions="all", reduce="max"),
                HiddenStatesSpec(points="embed", positions="all")][pick]

    def steers() -> list[Any]:
        v = rng.choice(vectors)
        layer = rng.randrange(layers)
        return [[Steer(layers=[layer], point="resid_post", vector=v, scale=2.0)],
                [Steer(layers=[layer], point="attn_out", op="ablate", vector=v, positions="generated")],
                [Steer(layers=[layer], point="mlp_out", op="scale", scale=0.5),
                 Steer(layers=[layer], point="mlp_out", vector=v, scale=0.5)],
                [Steer(layers=[layer], point="resid_mid", op="clamp", vector=v, value=1.0, positions="prompt")],
                [Steer(layers=[layer], point="z", heads=[0], vector=torch.ones(hidden // 8))],
                [Steer(layers=[layer], point="mlp_post", op="scale", neurons=[1, 2, 3], scale=0.0)]][rng.randrange(6)]

    out = []
    step = 0
    kinds, weights = zip(*TRACE_KINDS.items())
    for i in range(n):
        if rng.random() < 0.5:
            step += 1
        prompt = [rng.randrange(100, VOCAB) for _ in range(rng.randint(3, 40))]
        kind = rng.choices(kinds, weights)[0]
        kw: dict[str, Any] = dict(max_tokens=rng.randint(2, 12), temperature=0, ignore_eos=True)
        if kind in ("capture", "both"):
            kw["hidden_states"] = spec()
        if kind in ("steer", "both"):
            kw["steering"] = steers()
        if kind == "sampled":
            kw.update(temperature=0.8, top_p=0.9, seed=i)
        if kind == "logprobs":
            kw.update(logprobs=2, prompt_logprobs=1)
        out.append((step, prompt, SamplingParams(**kw)))
    return out


def run_trace(llm: Any, reqs: list[tuple[int, list[int], Any]]) -> dict[str, Any]:
    """Feed the requests to the engine at their arrival steps; returns every finished output by id."""
    engine = llm.engine
    outputs: dict[str, Any] = {}
    pending = list(enumerate(reqs))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add(engine.input_processor.prepare(prompt, params, request_id=f"t{i}"))
        for req in engine.step():
            outputs[req.request_id] = engine.make_output(req)
        step += 1
    return outputs


def trace(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The serving trace through the graph path and through the eager step (see the module docstring)."""
    from tapllm import LLM

    folder = model_folder(root, args.trace_layers)
    reqs = trace_requests(args.trace_requests, 256, args.trace_layers, args.trace_seed)
    common = dict(dtype="float32", load_format="dummy", max_num_seqs=16, max_num_batched_tokens=128,
                  max_model_len=256, enable_prefix_caching=True)
    graphed = LLM(folder, backend="cuda", cuda_graph_sizes=[1, 2, 4, 8, 16],
                  cuda_graph_token_sizes=[16, 32, 64, 128], **common)
    t0 = time.perf_counter()
    got = run_trace(graphed, reqs)
    seconds = time.perf_counter() - t0
    want = run_trace(LLM(folder, enforce_eager=True, **common), reqs)
    runner = graphed.engine.runner
    policy, graphs = runner.policy, runner.graph_step.graphs
    same, worst = 0, 0.0
    for rid, a in want.items():
        b = got[rid]
        same += a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.hidden_states is not None:
            for point in a.hidden_states.points:
                x, y = a.hidden_states[point].float(), b.hidden_states[point].float()
                if x.numel():
                    worst = max(worst, float((x - y).abs().max()) / max(1.0, float(x.abs().max())))
            if a.hidden_states.features is not None:
                same -= not torch.equal(a.hidden_states.features.ids, b.hidden_states.features.ids)
    steps = policy.graph_steps + sum(policy.eager_steps.values())
    return {"requests": len(reqs), "steps": steps, "graph_steps": policy.graph_steps,
            "eager_reasons": dict(policy.eager_steps), "eager_share": policy.eager_share,
            "captures_after_warmup": graphs.captures_after_warmup, "distinct_graphs": graphs.distinct_graphs,
            "buckets": graphs.buckets, "draws_in_step_graphs": graphs.draws_in_step,
            "tokens_equal": f"{same}/{len(want)}", "max_state_error": worst,
            "left_out": "attention patterns and SAE feature edits (eager by design)", "seconds": round(seconds, 1)}


TRITON: TritonCount


def main(argv: list[str] | None = None) -> int:
    global TRITON
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    p.add_argument("--cases", default=None, help="comma-separated cases (default: all)")
    p.add_argument("--layers", type=int, default=16, help="blocks of the Llama (default 16)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--timed-steps", type=int, default=100, help="decode steps timed per cell (the fastest is kept)")
    p.add_argument("--interpreted-timing", action="store_true",
                   help="also time steps that run the interpreted graph body and SAE encoder every step (slow)")
    p.add_argument("--skip-trace", action="store_true")
    p.add_argument("--trace-requests", type=int, default=500, help="requests in the serving trace (default 500)")
    p.add_argument("--trace-layers", type=int, default=2, help="blocks of the trace's Llama (default 2)")
    p.add_argument("--trace-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: one per CPU)")
    args = p.parse_args(argv)
    from tapllm.kernels import triton_attention, triton_elementwise, triton_fused_sites, triton_sae, triton_tap

    TRITON = TritonCount([m for m in (triton_attention._kernels(), triton_elementwise._kernels(),
                                      triton_fused_sites._kernels(), triton_tap._kernels(), triton_sae._kernels())
                          if m is not None])
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    batches = [int(b) for b in args.batches.split(",")]
    report: dict[str, Any] = {"machine": _machine(), "torch": torch.__version__, "dtype": args.dtype,
                              "layers": args.layers, "date": time.strftime("%Y-%m-%d"), "commit": _commit()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), args.layers)
        llm = cuda_llm(folder, args.dtype, max(batches))
        for key, case in (("kernels", "plain"), ("kernels_tapped", "last")):
            report[key] = k = kernels_per_block(llm, args, case)
            print(f"kernels per block{' (tapped)' if case != 'plain' else ''}: {k['kernels_per_block']} "
                  f"({k['block_kernels']}); per step {k['per_step_kernels']}, and {k['draw_kernels']} in the "
                  f"conditional draw", flush=True)
        names = args.cases.split(",") if args.cases else list(cases(256, args.layers))
        all_cases = cases(256, args.layers)
        report["host_ops"], report["host_ms"], report["host_detail"] = {}, {}, {}
        for case in names:
            for b in batches:
                row = measure_step(llm, all_cases[case], b, 1000 + b, args)
                report["host_ops"].setdefault(case, {})[b] = row["host_ops"]
                report["host_ms"].setdefault(case, {})[b] = row["host_ms"]
                report["host_detail"].setdefault(case, {})[b] = row
                print(f"{case:16s} b{b:<3d} host ops {row['host_ops']:4d}  host ms {row['host_ms']:.3f}  "
                      f"syncs {len(row['syncs'])}", flush=True)
    if not args.skip_trace:
        with tempfile.TemporaryDirectory() as tmp:
            report["trace"] = trace(Path(tmp), args)
        t = report["trace"]
        print(f"trace: {t['requests']} requests, {t['steps']} steps: eager {t['eager_share']:.1%} "
              f"({t['eager_reasons']}), captures after warm-up {t['captures_after_warmup']}, "
              f"{t['distinct_graphs']} graphs for {t['buckets']} buckets; equal to the eager path: tokens "
              f"{t['tokens_equal']}, states within {t['max_state_error']:.1e} of their scale", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


def _machine() -> str:
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
