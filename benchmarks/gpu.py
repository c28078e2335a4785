"""tapllm on one GPU in one command: parity, speed against transformers and the weights' streaming
time, capture and steering costs, a serving scenario and where a decode step's time goes.

What it measures (random weights; every figure in one run of under 8 minutes, so ratios are fair)
    1. The GPU's read bandwidth: a plain reduction over a 4 GB tensor (best of 5).
    2. Parity, float32 and bfloat16, on a small Llama (4 blocks, hidden 256, grouped-query attention,
       llama3 rotary): six prompts (two of 300 tokens, run in chunks of at most 256 tokens), 8 greedy
       tokens, on three paths of the graph engine: *plain* graphs, *tapped* graphs (every block's
       ``resid_pre`` and the final norm's output at every position) and *steered* graphs (an add at
       ``resid_post`` of two blocks, an ablation of one block's ``attn_out``, an add on two heads of
       ``z``; captured as the tapped path). Each against tapllm ``enforce_eager=True`` and against
       transformers on the same device (``generate``; states from ``output_hidden_states``, or for
       the steered path from forward hooks doing the same operations): greedy tokens equal
       (``tokens_equal`` "6/6") and the largest error relative to the largest magnitude (at least 1)
       of the chosen tokens' logprobs (plain path) or of the states (tapped, steered).
    3. Speed, per model shape (the Llama-3.2-1B and Llama-3.1-8B blocks, bf16, the default tokenizer's
       49,152-token vocabulary): tapllm (CUDA graphs), transformers ``generate`` and tapllm
       ``enforce_eager=True``: output tokens/s of greedy generation at batch 1, 16, 64 (and 256 for
       tapllm), prompts of 128 random tokens, 64 new, EOS ignored, best of 2 with fresh prompts;
       start-up (weights, KV cache, every graph captured, Triton's compilations on a fresh machine),
       peak GPU memory; the batch-1 decode step (the median of 64 engine steps timed one by one)
       against the weights' bytes over the bandwidth of (1).
    4. What capture and steering cost under graphs (1B shape, batch 16; best of 3 rounds): the last
       position's final state, a mean over the prompt at 3 blocks, 3 blocks at every position, every
       block at every position, half the batch steered at 3 blocks, an SAE's top-16 features at one
       block; each as a share of the plain run's throughput.
    5. A serving scenario (1B shape): requests arriving over engine steps (a Poisson schedule, driven
       through ``engine.add`` and ``engine.step``), prompts of 32-512 tokens, 16-128 new, so steps mix
       prefill chunks and decodes; run plain, then on the same schedule with fresh prompts and half the
       requests tapped (capturing 3 blocks at every position, or steered at 3 blocks): throughput,
       p50/p99 inter-token latency, eager steps and why, graphs captured after start-up.
    6. Where a plain decode step's time goes (1B shape, batch 1 and 16): the graph replay's device
       time (CUDA events around it) against the whole step's wall time, median of 32 steps.
    7. Mixture of experts (benchmarks/gpu_moe.py; the CUDA backend's Triton fused-MoE step in graphs):
       float32 parity of a small Mixtral and a small Qwen3-MoE (the parity Llama's shape, 8 experts,
       top-2; three prompts, one run in chunks, 8 greedy tokens): graph engine against ``enforce_eager``
       and transformers, plain (tokens, chosen tokens' logprobs), ``router_logits`` at every block and
       position (against ``output_router_logits``) and a routing ban at two blocks (graph against eager,
       no banned expert chosen); decode steps run eagerly, by reason. Then bf16 speed of a
       Qwen3-30B-A3B-shaped model (``--moe-layers`` blocks, 8 by default; 128 experts, top-8): tapllm
       (graphs) and transformers at batch 1, 16, 64, and the batch-1 step against the active weights'
       streaming time (attention, routers, norms, head and ``top_k`` experts per block).

Targets (on a GPU; printed PASS or MISS, and in the JSON under ``targets``)
    parity float32, every path: greedy tokens 6/6 against transformers and the eager step, states
    within 1e-4; batch-1 step <= 2.0x the weights' streaming time (1B), <= 1.5x (8B); 1B batch 16
    and 64 >= 6x transformers; 8B batch 256 >= 12,000 tokens/s; capture costs <= 1% (last
    position), 1% (a mean), 5% (3 blocks, every position), 15% (every block, every position), 2.5%
    (half the batch steered), 5% (SAE top-16); serving: eager steps <= 2%, half tapped >= 0.9x the
    plain run's throughput, no graph captured after start-up; mixture of experts: float32 greedy
    tokens all equal (every family and path, against transformers and eager; the ban held), errors
    within 1e-4, no decode step run eagerly, batch 16 and 64 >= 3x transformers.

How to run
    python benchmarks/gpu.py --prepare .gpu        # here: the tokenizer, for a machine without the model
    python benchmarks/gpu.py --tokenizer .gpu/tokenizer --json $OUT/gpu.json --commit <sha>
    python benchmarks/gpu.py --smoke               # the same code on CPU with tiny shapes, a few minutes

The run's order puts the most telling figures first: bandwidth, parity, the 1B shape's speed (its
graph engine then serves the step split, capture costs and serving), mixture of experts, the 8B
shape's speed, and last the eager reference step's speed on both shapes. ``--only`` picks sections
(``--only moe``: that one alone).

``--smoke`` runs every section on the CPU: the graph engines use ``backend="cuda"`` (Triton's
interpreter, graphs emulated), so the graph path's code runs as it would on a GPU; its figures
check the script, not the GPU. ``--budget`` (seconds, default 400) skips the sections (and the
rows inside them) not started in time; a section that fails is reported and the others still run.
The JSON (``--json``, written after every section) holds every figure printed, the versions, the
GPU, the date and the git commit.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv[1:]:  # before anything imports triton: the CUDA path's kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import gc
import json
import platform
import random
import statistics
import subprocess
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
for _path in (REPO_ROOT, Path(__file__).resolve().parent):  # tapllm, and the sections' modules (gpu_moe)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
if __name__ == "__main__":  # the sections' modules import this one as ``gpu``: the same module, not a copy
    sys.modules.setdefault("gpu", sys.modules[__name__])

VOCAB = 49152
FIRST_TOKEN_ID = 100  # away from the special tokens
PATHS = ("plain", "tapped", "steered")
CAPTURE_TARGETS = {"last position (final)": 1.0, "mean over the prompt, 3 blocks": 1.0,
                   "3 blocks, every position": 5.0, "every block, every position": 15.0,
                   "half the batch steered": 2.5, "SAE top-16, one block": 5.0}


# ---- sizes ----------------------------------------------------------------------------------
@dataclass
class Sizes:
    """Every size the sections use: the GPU run's, or the smoke run's tiny ones."""

    prompt_len: int = 128
    new_tokens: int = 64
    batches: list[int] = field(default_factory=lambda: [1, 16, 64, 256])
    hf_max_batch: int = 64
    eager_max_batch: int = 64
    runs: int = 2
    step_tokens: int = 64
    step_runs: int = 3
    kv_gb: float = 16.0
    max_model_len: int = 1024
    capture_batch: int = 16
    capture_rounds: int = 3
    parity_prompts: list[int] = field(default_factory=lambda: [40, 40, 40, 40, 300, 300])
    parity_new: int = 8
    parity_step_tokens: int = 256
    serve_requests: int = 256
    serve_rate: float = 2.0  # arrivals per engine step
    serve_prompt: tuple[int, int] = (32, 512)
    serve_output: tuple[int, int] = (16, 128)
    serve_warm: int = 16
    split_batches: list[int] = field(default_factory=lambda: [1, 16])
    split_steps: int = 32
    bandwidth_bytes: float = 4e9
    graph_options: dict[str, Any] = field(default_factory=dict)  # more options of every graph engine
    step_token_budget: int | None = None  # max_num_batched_tokens of the speed engines (None: from the batch)


def smoke_sizes() -> Sizes:
    """Tiny shapes for the CPU: the Triton interpreter takes about a second per step of a 1-block model."""
    return Sizes(prompt_len=6, new_tokens=3, batches=[1, 2], hf_max_batch=2, eager_max_batch=2, runs=1,
                 step_tokens=2, step_runs=1, kv_gb=0.05, max_model_len=128, capture_batch=2, capture_rounds=1,
                 parity_prompts=[3, 4, 9], parity_new=2, parity_step_tokens=16, serve_requests=4, serve_rate=1.0,
                 serve_prompt=(3, 6), serve_output=(2, 3), serve_warm=0, split_batches=[1, 2], split_steps=2,
                 bandwidth_bytes=64e6, step_token_budget=16,
                 graph_options={"backend": "cuda", "cuda_graph_sizes": [1, 2, 4], "cuda_graph_token_sizes": [16]})


# ---- shapes -------------------------------------------------------------------------------
def model_configs(smoke: bool) -> dict[str, Any]:
    """name -> a transformers ``LlamaConfig`` of that shape (random weights are made from it)."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if smoke:
        rope = {**rope, "original_max_position_embeddings": 64}
        return {
            "tiny-a": LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                                  max_position_embeddings=1024, rope_parameters=rope),
            "tiny-b": LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=128, tie_word_embeddings=False,
                                  max_position_embeddings=1024, rope_parameters=rope),
        }
    return {
        # Llama-3.2-1B's blocks (the vocabulary is the default tokenizer's).
        "1b": LlamaConfig(vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
                          max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=rope),
        # Llama-3.1-8B's blocks.
        "8b": LlamaConfig(vocab_size=VOCAB, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                          max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=rope),
    }


def parity_config(smoke: bool) -> Any:
    """The parity model: small, peaked logits (no near-ties for greedy decoding to trip on)."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    if smoke:
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                           initializer_range=0.2, rope_parameters={**rope, "original_max_position_embeddings": 16})
    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, intermediate_size=512, max_position_embeddings=2048,
                       initializer_range=0.2, rope_parameters=rope)


def model_folder(root: Path, name: str, config: Any, tokenizer: Path) -> Path:
    """A folder with the shape's ``config.json`` and the tokenizer: what ``load_format="dummy"`` reads."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    config.architectures = config.architectures or ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    for f in tokenizer.iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja")):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def default_tokenizer() -> Path:
    """The default model's folder (its tokenizer files), converted from its GGUF file if needed."""
    from tapllm.loader import resolve_model

    return resolve_model(None)


def prepare(out: Path) -> None:
    """Write the tokenizer files a GPU machine without the default model needs, under ``out/tokenizer``."""
    src = default_tokenizer()
    dst = out / "tokenizer"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja")):
            (dst / f.name).write_bytes(f.read_bytes())
    print(f"wrote {dst} ({sum(f.stat().st_size for f in dst.iterdir()) / 1e6:.1f} MB)")


# ---- helpers --------------------------------------------------------------------------------
def prompts(batch: int, length: int, seed: str) -> list[list[int]]:
    """Fresh random token ids: a different ``seed`` never repeats a prefix (no prefix-cache hits)."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(length)] for _ in range(batch)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def bandwidth_gbs(device: torch.device, nbytes: float) -> float:
    """GB/s of a plain read: ``sum`` over a bf16 tensor of ``nbytes`` (best of 5)."""
    x = torch.ones(int(nbytes // 2), dtype=torch.bfloat16, device=device)
    x.sum()
    best = float("inf")
    for _ in range(5):
        best = min(best, timed(device, lambda: x.sum())[0])
    del x
    free(device)
    return nbytes / best / 1e9


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude (at least 1)."""
    got, want = got.float().cpu(), want.float().cpu()
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} against {tuple(want.shape)}")
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def policy_counts(llm: Any) -> tuple[int, Counter[str], Counter[Any], int]:
    """(graph steps, eager steps by reason, replays by graph, graphs captured after start-up) so far."""
    runner = llm.engine.runner
    graphs = runner.graph_step.graphs if runner.graph_step is not None else None
    return (runner.policy.graph_steps, Counter(runner.policy.eager_steps),
            Counter(graphs.replays) if graphs is not None else Counter(),
            graphs.captures_after_warmup if graphs is not None else 0)


def policy_delta(llm: Any, before: tuple[int, Counter[str], Counter[Any], int]) -> dict[str, Any]:
    """What :func:`policy_counts` gained since ``before``: the steps' paths, in JSON form."""
    graph, eager, replays, late = policy_counts(llm)
    by_kind: Counter[str] = Counter()
    for key, n in (replays - before[2]).items():
        by_kind[f"{key.kind}{' tapped' if key.tapped else ''}"] += n
    return {"graph_steps": graph - before[0], "eager_steps": dict(eager - before[1]), "replays": dict(by_kind),
            "captures_after_warmup": late - before[3]}


def describe_config(config: Any) -> str:
    return (f"{config.num_hidden_layers} blocks, hidden {config.hidden_size}, {config.num_attention_heads}/"
            f"{config.num_key_value_heads} heads, MLP {config.intermediate_size}, vocab {config.vocab_size}")


# ---- the run --------------------------------------------------------------------------------
class Bench:
    """What the sections share: the options, the device, the models' folders, the report, and one graph
    engine at a time (the first shape's serves its speed, the step split, capture costs and serving)."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, device: torch.device, root: Path,
                 tokenizer: Path) -> None:
        self.args = args
        self.sizes = sizes
        self.device = device
        self.root = root
        self.tokenizer = tokenizer
        self.configs = model_configs(args.smoke)
        self.report: dict[str, Any] = {}
        self.bandwidth = 0.0
        self._graph: tuple[str, Any] | None = None
        self._failed: dict[str, str] = {}  # shape -> why its graph engine did not start (not tried again)
        self.graph_summaries: dict[str, dict[str, Any]] = {}
        self.moe_sizes: Any = None  # gpu_moe.MoESizes, set by main

    def over(self) -> bool:
        """True once the time budget is spent."""
        return self.args.deadline is not None and time.monotonic() > self.args.deadline

    def shape(self, which: int) -> tuple[str, Any, Path]:
        name, config = list(self.configs.items())[which]
        return name, config, model_folder(self.root, name, config, self.tokenizer)

    def options(self, max_batch: int, eager: bool) -> dict[str, Any]:
        """The ``LLM`` options of a speed engine (random weights, no prefix cache)."""
        s = self.sizes
        budget = s.step_token_budget or max(2048, s.prompt_len * min(max_batch, 64))
        kw = dict(dtype=self.args.dtype, device=str(self.device), load_format="dummy", enforce_eager=eager,
                  max_num_seqs=max_batch, max_num_batched_tokens=budget, max_model_len=s.max_model_len,
                  kv_cache_memory_gb=s.kv_gb, enable_prefix_caching=False)
        return kw if eager else {**kw, **s.graph_options}

    def graph_engine(self, which: int) -> Any:
        """The graph engine of shape ``which`` (made on first use; another shape's is dropped first)."""
        name, config, folder = self.shape(which)
        if self._graph is not None and self._graph[0] == name:
            return self._graph[1]
        if name in self._failed:
            raise RuntimeError(f"the {name} graph engine did not start: {self._failed[name]}")
        self.drop_graph_engine()
        from tapllm import LLM

        s = self.sizes
        reset_peak(self.device)
        max_batch = max(s.batches + [s.capture_batch] + s.split_batches)
        try:
            start, llm = timed(self.device, lambda: LLM(folder, **self.options(max_batch, eager=False)))
        except Exception as exc:
            self._failed[name] = f"{type(exc).__name__}: {exc}"
            raise
        graphs = llm.engine.runner.graph_step.graphs if llm.engine.runner.graph_step is not None else None
        self.graph_summaries[name] = {
            "startup_s": round(start, 2), "describe": llm.describe(),
            "graph_capture_s": round(graphs.capture_seconds, 2) if graphs is not None else None,
            "graphs": graphs.distinct_graphs if graphs is not None else 0,
            "buckets": graphs.buckets if graphs is not None else 0,
            "draws_in_step_graphs": graphs.draws_in_step if graphs is not None else None}
        print(f"\ntapllm on {name} ({describe_config(config)}), started in {start:.1f}s:\n{llm.describe()}",
              flush=True)
        self._graph = (name, llm)
        return llm

    def drop_graph_engine(self) -> None:
        if self._graph is None:
            return
        name, llm = self._graph
        self._graph = None
        self.graph_summaries[name].update(policy_delta(llm, (0, Counter(), Counter(), 0)))
        self.report.setdefault("graph_engines", {})[name] = self.graph_summaries[name]
        del llm
        free(self.device)


# ---- engines --------------------------------------------------------------------------------
def tapllm_rate(llm: Any, device: torch.device, batch: int, new: int, prompt_len: int, seed: str, runs: int = 2
                ) -> float:
    """Output tokens/s of greedy generation, best of ``runs`` with fresh prompts."""
    from tapllm import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    best = 0.0
    for r in range(runs):
        ps = prompts(batch, prompt_len, f"{seed}-b{batch}-r{r}")
        seconds, outs = timed(device, lambda: llm.generate(ps, params, use_tqdm=False))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, tokens / seconds)
    return best


def decode_step_ms(llm: Any, device: torch.device, prompt_len: int, seed: str, steps: int = 64,
                   runs: int = 3) -> float:
    """One batch-1 decode step: the median wall time of ``steps`` engine steps after the prompt's, each
    timed on its own (device synced), best of ``runs`` requests with fresh prompts. (A difference of two
    generation times, as this once was, can come out at or below zero on a loaded machine.)"""
    from tapllm import SamplingParams

    engine = llm.engine
    best = float("inf")
    for r in range(runs):
        rid = f"{seed}-step-{r}"
        params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
        req = engine.add(engine.input_processor.prepare(prompts(1, prompt_len, rid)[0], params, request_id=rid))
        while not req.output_token_ids:  # the prompt
            engine.step()
        walls = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            walls.append(time.perf_counter() - t0)
        engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
        best = min(best, statistics.median(walls))
    return best * 1e3


def hf_model(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def hf_rate(model: Any, device: torch.device, batch: int, new: int, prompt_len: int, seed: str, runs: int = 2
            ) -> float:
    """transformers ``generate`` output tokens/s, best of ``runs`` with fresh prompts."""
    best = 0.0
    for r in range(runs):
        ids = torch.tensor(prompts(batch, prompt_len, f"{seed}-hf-b{batch}-r{r}"), device=device)
        with torch.inference_mode():
            seconds, out = timed(device, lambda: model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0))
        best = max(best, (out.shape[1] - ids.shape[1]) * batch / seconds)
    return best


def weight_bytes(llm: Any) -> int:
    model = llm.engine.runner.model
    return sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())


# ---- section: speed -------------------------------------------------------------------------
def speed(b: Bench, which: int) -> None:
    """tapllm's graph engine, then transformers, on shape ``which``."""
    s, device = b.sizes, b.device
    name, config, _ = b.shape(which)
    rows = b.report.setdefault("models", {}).setdefault(name, {})
    llm = b.graph_engine(which)
    row: dict[str, Any] = {k: v for k, v in b.graph_summaries[name].items()}
    rows["tapllm"] = row
    tapllm_rate(llm, device, min(4, max(s.batches)), min(4, s.new_tokens), s.prompt_len, f"{name}-warm", 1)
    for batch in s.batches:
        if b.over():
            row[f"b{batch}"] = "skipped: time budget"
            continue
        row[f"b{batch}"] = round(tapllm_rate(llm, device, batch, s.new_tokens, s.prompt_len, f"{name}-tapllm",
                                             s.runs), 1)
    step_row(b, llm, row, f"{name}-tapllm")
    row["peak_gpu_gb"] = peak_memory_gb(device)
    if not b.args.skip_hf and not b.over():
        reset_peak(device)
        model = hf_model(config, device, getattr(torch, b.args.dtype))
        hf: dict[str, Any] = {}
        for batch in [x for x in s.batches if x <= s.hf_max_batch]:
            if b.over():
                hf[f"b{batch}"] = "skipped: time budget"
                continue
            hf[f"b{batch}"] = round(hf_rate(model, device, batch, s.new_tokens, s.prompt_len, name, s.runs), 1)
        hf["peak_gpu_gb"] = peak_memory_gb(device)
        rows["transformers"] = hf
        del model
        free(device)
    compare_to_transformers(rows, s.batches)
    print_model(name, rows, s)


def step_row(b: Bench, llm: Any, row: dict[str, Any], seed: str) -> None:
    """The batch-1 decode step against the weights' streaming time, into ``row``."""
    s = b.sizes
    if b.over():
        row["step_ms"] = "skipped: time budget"
        return
    step = decode_step_ms(llm, b.device, s.prompt_len, seed, s.step_tokens, s.step_runs)
    nbytes = weight_bytes(llm)
    bound = nbytes / (b.bandwidth * 1e9) * 1e3
    row.update(step_ms=round(step, 3), bound_ms=round(bound, 3), step_over_bound=round(step / bound, 2),
               weights_gb=round(nbytes / 1e9, 3))


def eager_speed(b: Bench, which: int) -> None:
    """tapllm ``enforce_eager=True`` (the PyTorch reference step) on shape ``which``."""
    from tapllm import LLM

    s, device = b.sizes, b.device
    name, config, folder = b.shape(which)
    rows = b.report.setdefault("models", {}).setdefault(name, {})
    batches = [x for x in s.batches if x <= s.eager_max_batch]
    reset_peak(device)
    start, llm = timed(device, lambda: LLM(folder, **b.options(max(batches), eager=True)))
    row: dict[str, Any] = {"startup_s": round(start, 2), "describe": llm.describe()}
    rows["tapllm-eager"] = row
    tapllm_rate(llm, device, min(4, max(batches)), min(4, s.new_tokens), s.prompt_len, f"{name}-eager-warm", 1)
    for batch in batches:
        if b.over():
            row[f"b{batch}"] = "skipped: time budget"
            continue
        row[f"b{batch}"] = round(tapllm_rate(llm, device, batch, s.new_tokens, s.prompt_len, f"{name}-eager",
                                             s.runs), 1)
    step_row(b, llm, row, f"{name}-eager")
    row["peak_gpu_gb"] = peak_memory_gb(device)
    del llm
    free(device)
    compare_to_transformers(rows, s.batches)
    print_model(name, rows, s)


def compare_to_transformers(rows: dict[str, Any], batches: list[int]) -> None:
    """Each tapllm engine's tokens/s over transformers' at the same batch (``b<n>_vs_transformers``)."""
    hf = rows.get("transformers", {})
    for engine in ("tapllm", "tapllm-eager"):
        for batch in batches:
            ours, theirs = rows.get(engine, {}).get(f"b{batch}"), hf.get(f"b{batch}")
            if isinstance(ours, float) and isinstance(theirs, float) and theirs > 0:
                rows[engine][f"b{batch}_vs_transformers"] = round(ours / theirs, 2)


def print_model(name: str, rows: dict[str, Any], s: Sizes) -> None:
    print(f"\n== {name}: output tokens/s (prompt {s.prompt_len}, {s.new_tokens} new, greedy), and vs transformers")
    print(f"{'engine':14s}" + "".join(f"{'b' + str(b):>16s}" for b in s.batches) + f"{'step ms':>10s}{'/bound':>8s}"
          f"{'start s':>9s}{'peak GB':>9s}")
    for engine, row in rows.items():
        cells = ""
        for batch in s.batches:
            v, r = row.get(f"b{batch}"), row.get(f"b{batch}_vs_transformers")
            text = "-" if not isinstance(v, float) else f"{v:,.0f}" + (f" ({r:.2f}x)" if r else "")
            cells += f"{text:>16s}"
        step = f"{row['step_ms']:>10.2f}{row['step_over_bound']:>8.2f}" if isinstance(row.get("step_ms"), float) \
            else f"{'':>18s}"
        start = f"{row['startup_s']:>9.1f}" if "startup_s" in row else f"{'':>9s}"
        peak = f"{row['peak_gpu_gb']:>9.1f}" if row.get("peak_gpu_gb") is not None else f"{'':>9s}"
        print(f"{engine:14s}{cells}{step}{start}{peak}")


# ---- section: where a decode step's time goes -------------------------------------------------
class ReplayTimer:
    """Times every replay of a ``GraphRunner``: CUDA events around it on a GPU (the graph's device
    time), the wall clock around the emulated graph body on a CPU."""

    def __init__(self, graphs: Any, device: torch.device) -> None:
        self.graphs = graphs
        self.device = device
        self.runs: list[tuple[Any, Any, Any]] = []

    def __enter__(self) -> ReplayTimer:
        replay = self.graphs.run

        def run(key: Any) -> Any:
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = replay(key)
                end.record()
                self.runs.append((key, start, end))
            else:
                t0 = time.perf_counter()
                out = replay(key)
                self.runs.append((key, t0, time.perf_counter()))
            return out

        self.graphs.run = run  # an instance attribute: the engine's calls find it first
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.graphs.run

    def ms(self, i: int) -> float:
        _, start, end = self.runs[i]
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


def step_split(b: Bench) -> None:
    """The plain decode step at each batch of ``split_batches``: graph replay (device) against the whole step."""
    from tapllm import SamplingParams

    s, device = b.sizes, b.device
    llm = b.graph_engine(0)
    engine = llm.engine
    if engine.runner.graph_step is None:
        raise RuntimeError(f"no graphs on this engine ({engine.runner.policy.off})")
    graphs = engine.runner.graph_step.graphs
    rows: dict[str, Any] = {}
    b.report["step_split"] = {"model": b.shape(0)[0], "prompt_len": s.prompt_len, "rows": rows,
                              "timer": "CUDA events" if device.type == "cuda" else "wall clock (emulated graphs)"}
    warm = 2
    for batch in s.split_batches:
        if b.over():
            rows[f"b{batch}"] = "skipped: time budget"
            continue
        params = SamplingParams(max_tokens=s.split_steps + warm + 4, temperature=0, ignore_eos=True)
        ids = [f"split-b{batch}-{i}" for i in range(batch)]
        reqs = [engine.add(engine.input_processor.prepare(p, params, request_id=rid))
                for p, rid in zip(prompts(batch, s.prompt_len, f"split-{batch}"), ids)]
        while any(not r.output_token_ids for r in reqs):  # the prompts
            engine.step()
        walls, replays = [], []
        with ReplayTimer(graphs, device) as timer:
            for i in range(warm + s.split_steps):
                timer.runs.clear()
                sync(device)
                t0 = time.perf_counter()
                engine.step()
                sync(device)
                wall = (time.perf_counter() - t0) * 1e3
                key = timer.runs[0][0] if len(timer.runs) == 1 else None
                if i >= warm and key is not None and key.kind == "decode" and not key.tapped:
                    walls.append(wall)
                    replays.append(timer.ms(0))
        for rid in ids:
            engine.abort(rid)
        if not walls:
            rows[f"b{batch}"] = "no plain decode step replayed a graph"
            continue
        step, replay = statistics.median(walls), statistics.median(replays)
        rows[f"b{batch}"] = {"steps": len(walls), "step_ms": round(step, 3), "replay_ms": round(replay, 3),
                             "outside_replay_ms": round(statistics.median(w - r for w, r in zip(walls, replays)), 3),
                             "replay_share": round(replay / step, 3)}
    print(f"\n== a plain decode step on {b.report['step_split']['model']}: the graph replay's device time "
          f"({b.report['step_split']['timer']}) against the whole step's wall time (median)")
    for label, row in rows.items():
        if isinstance(row, dict):
            print(f"  {label:5s} step {row['step_ms']:8.3f} ms, replay {row['replay_ms']:8.3f} ms "
                  f"({100 * row['replay_share']:.0f}%), the rest {row['outside_replay_ms']:8.3f} ms")
        else:
            print(f"  {label:5s} {row}")


# ---- section: capture and steering costs -------------------------------------------------------
def capture_costs(b: Bench) -> None:
    """Each capture or steering case's throughput on the first shape's graph engine, against the plain run's."""
    from tapllm import HiddenStatesSpec, SamplingParams, Steer
    from tapllm.sae.model import SAE
    from tapllm.sae.sae_config import SAEConfig

    s, device = b.sizes, b.device
    name, config, _ = b.shape(0)
    llm = b.graph_engine(0)
    before = policy_counts(llm)
    batch, new, plen = s.capture_batch, s.new_tokens, s.prompt_len
    layers, hidden = config.num_hidden_layers, config.hidden_size
    three = sorted({min(1, layers - 1), layers // 2, layers - 1})
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(hidden, generator=g)
    d_sae = 16 * hidden
    sae = SAE(SAEConfig("topk", hidden, d_sae, point="resid_post", layer=layers // 2, k=64),
              torch.randn(hidden, d_sae, generator=g) / hidden**0.5, torch.zeros(d_sae),
              torch.randn(d_sae, hidden, generator=g) / d_sae**0.5, torch.zeros(hidden))
    cases: dict[str, Any] = {
        "none": None,
        "last position (final)": HiddenStatesSpec(points="final", positions="last"),
        "mean over the prompt, 3 blocks": HiddenStatesSpec(layers=three, points="resid_pre", positions="prompt",
                                                           reduce="mean"),
        "3 blocks, every position": HiddenStatesSpec(layers=three, points="resid_pre", positions="all"),
        "every block, every position": HiddenStatesSpec(layers="all", points="resid_post", positions="all"),
        "half the batch steered": [Steer(layers=three, point="resid_post", vector=direction, scale=0.5)],
        "SAE top-16, one block": HiddenStatesSpec(sae=sae, features="topk:16", positions="all"),
    }
    best: dict[str, float] = {}
    for r in range(s.capture_rounds):
        for label, spec in cases.items():
            if b.over():
                break
            ps = prompts(batch, plen, f"capture-{label}-{r}")
            if isinstance(spec, list):
                params: Any = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                                              steering=spec if i % 2 == 0 else None) for i in range(batch)]
            else:
                params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, hidden_states=spec)
            seconds, outs = timed(device, lambda: llm.generate(ps, params, use_tqdm=False))
            best[label] = max(best.get(label, 0.0), sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    base = best.get("none")
    rows = {label: {"tok_s": round(v, 1), "cost_pct": round(100 * (1 - v / base), 2) if base else None}
            for label, v in best.items()}
    b.report["capture"] = {"model": name, "batch": batch, "rounds": s.capture_rounds, "cases": rows,
                           "steps": policy_delta(llm, before)}
    print(f"\n== capture and steering on {name}, batch {batch} (cost = share of the plain run's throughput, "
          f"best of {s.capture_rounds})")
    for label, row in rows.items():
        cost = f"{row['cost_pct']:+.1f}%" if row["cost_pct"] is not None else ""
        print(f"  {label:34s}{row['tok_s']:>12,.0f} tok/s  {cost}")
    steps = b.report["capture"]["steps"]
    print(f"  graph steps {steps['graph_steps']}, eager steps {steps['eager_steps'] or 0}")


# ---- section: serving -------------------------------------------------------------------------
@dataclass(slots=True)
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int


def schedule(s: Sizes, count: int, seed: str) -> list[Arrival]:
    """``count`` requests arriving as a Poisson process of ``serve_rate`` per engine step."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(Arrival(int(t), rng.randint(*s.serve_prompt), rng.randint(*s.serve_output)))
        t += rng.expovariate(s.serve_rate)
    return out


def serve_once(b: Bench, llm: Any, arrivals: list[Arrival], label: str, tapped: bool) -> dict[str, Any]:
    """Drive the engine through ``arrivals``; half the requests tapped when ``tapped``."""
    from tapllm import HiddenStatesSpec, SamplingParams, Steer

    engine = llm.engine
    config = b.shape(0)[1]
    layers = config.num_hidden_layers
    three = sorted({min(1, layers - 1), layers // 2, layers - 1})
    direction = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(1))
    capture = HiddenStatesSpec(layers=three, points="resid_post", positions="all")
    steer = [Steer(layers=three, point="resid_post", vector=direction, scale=0.5)]
    rng = random.Random(f"serve-{label}")
    before = policy_counts(llm)
    pending = list(arrivals)
    seen: dict[Any, int] = {}
    last: dict[Any, float] = {}
    gaps: list[float] = []
    step = 0
    tokens0 = engine.num_generated_tokens
    sync(b.device)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, pending[0].step)  # nothing running: the next arrival comes now
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            i = len(arrivals) - len(pending) - 1
            extra: dict[str, Any] = {}
            if tapped and i % 2 == 1:
                extra = {"hidden_states": capture} if i % 4 == 1 else {"steering": steer}
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True, **extra)
            prompt = [rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(a.prompt_len)]
            seen[engine.add(engine.input_processor.prepare(prompt, params, request_id=f"serve-{label}-{i}"))] = 0
        done = engine.step()
        step += 1
        now = time.perf_counter()
        for req in list(seen):
            n = len(req.output_token_ids)
            if n > seen[req]:
                if seen[req]:
                    gaps.append((now - last[req]) * 1e3)
                seen[req], last[req] = n, now
            if req.finished:
                del seen[req]
                last.pop(req, None)
        for req in done:
            engine.make_output(req)
    sync(b.device)
    elapsed = time.perf_counter() - t0
    paths = policy_delta(llm, before)
    eager = sum(paths["eager_steps"].values())
    steps = eager + paths["graph_steps"]
    tokens = engine.num_generated_tokens - tokens0
    return {"requests": len(arrivals), "tapped_requests": len(arrivals) // 2 if tapped else 0, "steps": steps,
            "seconds": round(elapsed, 3), "output_tokens": tokens, "tok_s": round(tokens / elapsed, 1),
            "itl_p50_ms": round(quantile(gaps, 0.5) or 0.0, 3), "itl_p99_ms": round(quantile(gaps, 0.99) or 0.0, 3),
            "eager_share": round(eager / steps, 4) if steps else None, **paths}


def serving(b: Bench) -> None:
    """The serving scenario on the first shape: plain, then half tapped on the same schedule."""
    s = b.sizes
    llm = b.graph_engine(0)
    arrivals = schedule(s, s.serve_requests, "serve")
    if s.serve_warm:
        serve_once(b, llm, schedule(s, s.serve_warm, "serve-warm"), "warm", tapped=True)
    runs = {"plain": serve_once(b, llm, arrivals, "plain", tapped=False)}
    if not b.over():
        runs["half tapped"] = serve_once(b, llm, arrivals, "half-tapped", tapped=True)
    ratio = runs["half tapped"]["tok_s"] / runs["plain"]["tok_s"] if "half tapped" in runs else None
    b.report["serving"] = {
        "model": b.shape(0)[0], "requests": s.serve_requests, "arrivals_per_step": s.serve_rate,
        "prompt_tokens": list(s.serve_prompt), "new_tokens": list(s.serve_output),
        "tapped": "every other request: capturing 3 blocks at every position, or steered at 3 blocks",
        "runs": runs, "tapped_over_plain": round(ratio, 3) if ratio is not None else None}
    print(f"\n== serving on {b.shape(0)[0]}: {s.serve_requests} requests arriving at {s.serve_rate} per step "
          f"(Poisson), prompts {s.serve_prompt[0]}-{s.serve_prompt[1]}, {s.serve_output[0]}-{s.serve_output[1]} new")
    for label, r in runs.items():
        print(f"  {label:12s}{r['tok_s']:>10,.0f} tok/s, inter-token p50 {r['itl_p50_ms']:.2f} ms p99 "
              f"{r['itl_p99_ms']:.2f} ms, {r['steps']} steps, eager {100 * (r['eager_share'] or 0):.1f}% "
              f"{r['eager_steps'] or ''}, replays {r['replays']}, graphs captured after start-up "
              f"{r['captures_after_warmup']}")
    if ratio is not None:
        print(f"  half tapped / plain throughput: {ratio:.3f}")


# ---- section: parity ------------------------------------------------------------------------
class HFSteers:
    """Forward hooks on a transformers Llama doing the steered path's operations where tapllm does them:
    an add to a block's output (``resid_post``), an ablation of what attention adds (``attn_out``), an
    add to chosen heads of the output projection's input (``z``); and, when ``record``, the block
    inputs (``resid_pre``) and the final norm's output, after any steering."""

    def __init__(self, model: Any, steers: list[Any], record: bool) -> None:
        self.handles: list[Any] = []
        self.states: dict[str, list[torch.Tensor]] = {"resid_pre": [], "final": []}
        blocks = model.model.layers
        for s in steers:
            for layer in s.layers:
                block = blocks[layer]
                v = s.vector
                if s.point == "resid_post":
                    self.handles.append(block.register_forward_hook(
                        lambda m, i, o, v=v, k=s.scale: _replace(o, lambda x: x + k * v.to(x.device, x.dtype))))
                elif s.point == "attn_out" and s.op == "ablate":
                    self.handles.append(block.self_attn.register_forward_hook(
                        lambda m, i, o, v=v: _replace(o, lambda x: _ablate(x, v))))
                elif s.point == "z":
                    heads = block.self_attn.config.num_attention_heads
                    self.handles.append(block.self_attn.o_proj.register_forward_pre_hook(
                        lambda m, a, v=v, k=s.scale, h=list(s.heads), n=heads: (_add_heads(a[0], n, h, k * v),)))
                else:
                    raise ValueError(f"no hook for {s.point} {s.op}")
        if record:
            for block in blocks:
                self.handles.append(block.register_forward_pre_hook(
                    lambda m, a, k: self.states["resid_pre"].append((a[0] if a else k["hidden_states"])[0]),
                    with_kwargs=True))
            self.handles.append(model.model.norm.register_forward_hook(
                lambda m, i, o: self.states["final"].append(o[0])))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _replace(o: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return (fn(o[0]), *o[1:]) if isinstance(o, tuple) else fn(o)


def _ablate(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    d = (v / v.norm()).to(x.device, x.dtype)
    return x - (x @ d)[..., None] * d


def _add_heads(x: torch.Tensor, heads: int, chosen: list[int], v: torch.Tensor) -> torch.Tensor:
    y = x.view(*x.shape[:-1], heads, -1).clone()
    y[..., chosen, :] += v.to(x.device, x.dtype)
    return y.view(x.shape)


def parity_requests(config: Any) -> dict[str, tuple[Any, list[Any] | None]]:
    """path -> (hidden-state spec, steers) of its requests."""
    from tapllm import HiddenStatesSpec, Steer

    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    g = torch.Generator().manual_seed(7)

    def vector(n: int, norm: float) -> torch.Tensor:
        v = torch.randn(n, generator=g)
        return v * (norm / v.norm())

    states = HiddenStatesSpec(layers="all", points=["resid_pre", "final"], positions="all")
    steers = [Steer(layers=sorted({0, layers // 2}), point="resid_post", vector=vector(hidden, 6.0), scale=1.5),
              Steer(layers=[layers - 1], point="attn_out", op="ablate", vector=vector(hidden, 1.0)),
              Steer(layers=[layers // 2], point="z", heads=[1, heads - 1], vector=vector(hidden // heads, 4.0))]
    return {"plain": (None, None), "tapped": (states, None), "steered": (states, steers)}


def parity(b: Bench) -> None:
    """Every path of the graph engine against the eager step and transformers, in float32 and bfloat16."""
    from transformers import AutoModelForCausalLM

    config = parity_config(b.args.smoke)
    torch.manual_seed(0)
    folder = model_folder(b.root, "parity", config, b.tokenizer)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    s = b.sizes
    ps = [prompts(1, n, f"parity-{i}-{n}")[0] for i, n in enumerate(s.parity_prompts)]
    result: dict[str, Any] = {"model": describe_config(config), "prompts": s.parity_prompts,
                              "new_tokens": s.parity_new}
    b.report["parity"] = result
    for dtype in ("float32", "bfloat16"):
        if b.over():
            result[dtype] = "skipped: time budget"
            continue
        result[dtype] = parity_dtype(b, folder, config, ps, dtype)
    print(f"\n== parity on a small Llama ({result['model']}), {len(ps)} prompts, {s.parity_new} greedy tokens: "
          "graph path against transformers and the eager step on the same device")
    for dtype in ("float32", "bfloat16"):
        rows = result.get(dtype)
        if not isinstance(rows, dict):
            print(f"  {dtype}: {rows}")
            continue
        for path, r in rows.items():
            print(f"  {dtype:9s}{path:8s} tokens {r['tokens_equal']} (vs eager {r['tokens_vs_eager']}; eager vs "
                  f"transformers {r['eager_tokens_equal']}), error {r['max_rel_error']:.1e} (eager "
                  f"{r['eager_max_rel_error']:.1e}, graph vs eager {r['vs_eager_max_rel_error']:.1e}); "
                  f"{r['graph_steps']} graph steps, eager {r['eager_steps'] or 0}")


def parity_dtype(b: Bench, folder: Path, config: Any, ps: list[list[int]], dtype: str) -> dict[str, Any]:
    """One dtype's rows of :func:`parity`: tapllm's two engines run every path, then transformers checks them."""
    from transformers import AutoModelForCausalLM

    from tapllm import LLM, SamplingParams

    s, device = b.sizes, b.device
    requests = parity_requests(config)
    engine = dict(dtype=dtype, device=str(device), max_num_seqs=8, max_num_batched_tokens=s.parity_step_tokens,
                  max_model_len=max(s.parity_prompts) + s.parity_new + 16, enable_prefix_caching=False)
    outs: dict[str, dict[str, list[Any]]] = {"graph": {}, "eager": {}}
    steps: dict[str, dict[str, Any]] = {}
    for kind in ("graph", "eager"):
        llm = LLM(folder, **engine, **({"enforce_eager": True} if kind == "eager" else s.graph_options))
        for path, (spec, steers) in requests.items():
            before = policy_counts(llm)
            params = SamplingParams(max_tokens=s.parity_new, temperature=0, ignore_eos=True, hidden_states=spec,
                                    steering=steers, logprobs=0 if path == "plain" else None)
            outs[kind][path] = llm.generate(ps, params, use_tqdm=False)
            if kind == "graph":
                steps[path] = policy_delta(llm, before)
        del llm
        free(device)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    rows: dict[str, Any] = {}
    for path, (spec, steers) in requests.items():
        want_tokens = [hf_generate(hf, p, s.parity_new, steers, device) for p in ps]
        same = {"graph": 0, "eager": 0, "both": 0}
        errors: dict[str, float] = {"graph": 0.0, "eager": 0.0, "both": 0.0}
        for i, p in enumerate(ps):
            got = {kind: outs[kind][path][i] for kind in ("graph", "eager")}
            tokens = {kind: got[kind].outputs[0].token_ids for kind in got}
            for kind in ("graph", "eager"):
                same[kind] += tokens[kind] == want_tokens[i]
                errors[kind] = max(errors[kind], parity_error(hf, p, got[kind], path, steers, device))
            same["both"] += tokens["graph"] == tokens["eager"]
            if tokens["graph"] == tokens["eager"]:
                errors["both"] = max(errors["both"], max(
                    rel_error(_observed(got["graph"], path, k), _observed(got["eager"], path, k))
                    for k in _observed_keys(path)))
        n = len(ps)
        rows[path] = {"tokens_equal": f"{same['graph']}/{n}", "tokens_vs_eager": f"{same['both']}/{n}",
                      "eager_tokens_equal": f"{same['eager']}/{n}", "max_rel_error": errors["graph"],
                      "eager_max_rel_error": errors["eager"], "vs_eager_max_rel_error": errors["both"],
                      "compared": "the chosen tokens' logprobs" if path == "plain" else
                      "resid_pre of every block and the final norm's output, every position", **steps[path]}
    del hf
    free(device)
    return rows


def hf_generate(hf: Any, prompt: list[int], new: int, steers: list[Any] | None, device: torch.device) -> list[int]:
    """transformers' greedy tokens for ``prompt`` (under the steering hooks when ``steers``)."""
    hooks = HFSteers(hf, steers, record=False) if steers else None
    try:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)
    finally:
        if hooks is not None:
            hooks.remove()
    return out[0, len(prompt):].tolist()


def _observed_keys(path: str) -> tuple[str, ...]:
    return ("logprobs",) if path == "plain" else ("resid_pre", "final")


def _observed(out: Any, path: str, key: str) -> torch.Tensor:
    """What a tapllm output holds of ``key``: the chosen tokens' logprobs, or a captured point."""
    if key == "logprobs":
        c = out.outputs[0]
        return torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])
    return out.hidden_states[key].float()


def parity_error(hf: Any, prompt: list[int], out: Any, path: str, steers: list[Any] | None,
                 device: torch.device) -> float:
    """The largest relative error of a tapllm output against transformers over the same sequence."""
    seq = (prompt + out.outputs[0].token_ids)[:-1]  # the last sampled token is never run
    ids = torch.tensor([seq], device=device)
    hooks = HFSteers(hf, steers or [], record=True) if path == "steered" else None
    try:
        with torch.inference_mode():
            res = hf(input_ids=ids, output_hidden_states=path == "tapped")
    finally:
        if hooks is not None:
            hooks.remove()
    if path == "plain":
        logp = res.logits[0, len(prompt) - 1:].float().log_softmax(-1)
        want = logp.gather(1, torch.tensor(out.outputs[0].token_ids, device=device)[:, None])[:, 0]
        return rel_error(_observed(out, path, "logprobs"), want)
    if path == "tapped":
        layers = len(res.hidden_states) - 1  # embeddings, each block's output, the last one normed
        want_pre = torch.stack([res.hidden_states[i][0] for i in range(layers)], 1)
        want_final = res.hidden_states[layers][0][:, None]
    else:
        want_pre = torch.stack(hooks.states["resid_pre"], 1)
        want_final = hooks.states["final"][0][:, None]
    return max(rel_error(_observed(out, path, "resid_pre"), want_pre),
               rel_error(_observed(out, path, "final"), want_final))


# ---- targets --------------------------------------------------------------------------------
def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its value and PASS, MISS or NOT MEASURED."""
    rows: list[dict[str, Any]] = []

    def add(tid: str, label: str, value: Any, want: str, ok: Callable[[Any], bool]) -> None:
        status = "NOT MEASURED" if value is None else ("PASS" if ok(value) else "MISS")
        rows.append({"id": tid, "label": label, "value": value, "want": want, "status": status})

    parity = report.get("parity", {}).get("float32")
    for path in PATHS:
        r = parity.get(path) if isinstance(parity, dict) else None
        tokens = f"{r['tokens_equal']} vs transformers, {r['tokens_vs_eager']} vs eager" if r else None
        add(f"parity.float32.{path}.tokens", f"parity float32, {path} graphs: greedy tokens", tokens,
            "all equal", lambda v: all(a == b for a, b in (x.split()[0].split("/") for x in v.split(", "))))
        add(f"parity.float32.{path}.error", f"parity float32, {path} graphs: largest relative error",
            r["max_rel_error"] if r else None, "<= 1e-4", lambda v: v <= 1e-4)
    names = list(report.get("models", {}))
    first, second = (names + [None, None])[:2]

    def model_value(name: str | None, engine: str, key: str) -> Any:
        value = report.get("models", {}).get(name, {}).get(engine, {}).get(key) if name else None
        return value if isinstance(value, (int, float)) else None

    add("speed.small.step_over_bound", f"{first}: batch-1 step / weights' streaming time",
        model_value(first, "tapllm", "step_over_bound"), "<= 2.0", lambda v: v <= 2.0)
    add("speed.large.step_over_bound", f"{second}: batch-1 step / weights' streaming time",
        model_value(second, "tapllm", "step_over_bound"), "<= 1.5", lambda v: v <= 1.5)
    for batch in (16, 64):
        add(f"speed.small.b{batch}_vs_transformers", f"{first}: batch {batch} vs transformers",
            model_value(first, "tapllm", f"b{batch}_vs_transformers"), ">= 6x", lambda v: v >= 6.0)
    add("speed.large.b256_tok_s", f"{second}: batch 256 output tokens/s", model_value(second, "tapllm", "b256"),
        ">= 12,000", lambda v: v >= 12000)
    cases = report.get("capture", {}).get("cases", {})
    for label, limit in CAPTURE_TARGETS.items():
        add(f"capture.{label}", f"capture cost: {label} (%)", cases.get(label, {}).get("cost_pct"),
            f"<= {limit}%", lambda v, limit=limit: v <= limit)
    runs = report.get("serving", {}).get("runs", {})
    shares = [r["eager_share"] for r in runs.values() if r.get("eager_share") is not None]
    add("serving.eager_share", "serving: share of eager steps", max(shares) if shares else None, "<= 2%",
        lambda v: v <= 0.02)
    add("serving.tapped_over_plain", "serving: half tapped / plain throughput",
        report.get("serving", {}).get("tapped_over_plain"), ">= 0.9", lambda v: v >= 0.9)
    from gpu_moe import moe_targets

    moe_targets(report, add)
    late = [e["captures_after_warmup"] for e in report.get("graph_engines", {}).values()]
    add("graphs.captures_after_warmup", "graphs captured after start-up (every graph engine)",
        sum(late) if late else None, "0", lambda v: v == 0)
    return rows


def print_targets(rows: list[dict[str, Any]], smoke: bool) -> None:
    print("\n== targets" + (" (a CPU smoke run: these figures check the script, not a GPU)" if smoke else ""))
    for r in rows:
        value = r["value"]
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        print(f"  {r['status']:13s}{r['label']:58s}{text:>32s}  (want {r['want']})")


# ---- the run --------------------------------------------------------------------------------
def provenance(device: torch.device, commit: str | None) -> dict[str, Any]:
    """Versions, device, date and the git commit of this run."""
    import transformers

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    dirty = None
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip()
            dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                                        capture_output=True, text=True, check=True).stdout.strip())
        except (OSError, subprocess.CalledProcessError):
            commit = None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "uncommitted_changes": dirty}


def run_tests(args: argparse.Namespace, report: dict[str, Any]) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(REPO_ROOT / "tests")]
    print(f"\n== the cuda tests: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, timeout=args.test_timeout)
    report["cuda_tests"] = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    return proc.returncode


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Sizes]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, backend='cuda': checks the script itself")
    p.add_argument("--prepare", type=Path,
                   help="write the tokenizer files for a GPU machine into this folder, then exit")
    p.add_argument("--tokenizer", type=Path,
                   help="a folder with the default tokenizer's files (default: the default model's)")
    p.add_argument("--json", type=Path, help="also write every figure here (after every section)")
    p.add_argument("--commit", help="the git commit measured, where the checkout has no .git")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="of the speed, capture, serving and step sections")
    p.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=None)
    p.add_argument("--hf-max-batch", type=int, default=None, help="largest batch transformers runs")
    p.add_argument("--capture-batch", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--kv-gb", type=float, default=None, help="KV cache per engine (GB)")
    p.add_argument("--serve-requests", type=int, default=None)
    p.add_argument("--budget", type=float, default=400.0,
                   help="seconds of measuring before the sections (and rows) not yet started are skipped; 0: none")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--moe-layers", type=int, default=None,
                   help="blocks of the mixture-of-experts speed model (default 8; 1 on --smoke)")
    p.add_argument("--only", choices=["parity", "speed", "split", "capture", "serving", "moe", "eager"],
                   action="append",
                   help="run only these sections (repeatable)")
    p.add_argument("--tests", action="store_true", help="then run pytest -m cuda (not part of the 8 minutes)")
    p.add_argument("--test-timeout", type=int, default=900)
    args = p.parse_args(argv)
    sizes = smoke_sizes() if args.smoke else Sizes()
    for name in ("batches", "hf_max_batch", "capture_batch", "prompt_len", "new_tokens", "kv_gb", "serve_requests"):
        value = getattr(args, name)
        if value is not None:
            setattr(sizes, name, value)
    if args.smoke:
        args.dtype = "float32"
    return args, sizes


def main(argv: list[str] | None = None) -> int:
    args, sizes = parse_args(argv)
    if args.prepare is not None:
        prepare(args.prepare)
        return 0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA GPU here: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    args.deadline = time.monotonic() + args.budget if args.budget else None
    tokenizer = args.tokenizer or default_tokenizer()
    root = Path(os.environ.get("TAPLLM_GPU_BENCH_DIR", "/tmp/tapllm-gpu-bench"))
    root.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, sizes, device, root, tokenizer)
    import gpu_moe

    bench.moe_sizes = gpu_moe.MoESizes.of(args.smoke, args.moe_layers)
    report = bench.report
    report.update(provenance(device, args.commit))
    report.update(smoke=args.smoke, dtype=args.dtype, budget_s=args.budget, errors={}, skipped={})
    print(f"tapllm GPU check on {report['device']} (torch {report['torch']}, CUDA {report['cuda']}, triton "
          f"{report['triton']}, transformers {report['transformers']}, {args.dtype}; commit {report['commit']}, "
          f"{report['date']})", flush=True)
    started = time.monotonic()
    bench.bandwidth = bandwidth_gbs(device, sizes.bandwidth_bytes)
    report["bandwidth_gbs"] = round(bench.bandwidth, 1)
    print(f"read bandwidth: {bench.bandwidth:,.0f} GB/s")
    # The most telling figures first: parity, the first shape (its graph engine serves four sections),
    # mixture of experts, the second shape, then the eager reference step's speed.
    sections: list[tuple[str, str, Callable[[], None]]] = [
        ("parity", "parity", lambda: parity(bench)),
        ("speed", "speed-0", lambda: speed(bench, 0)),
        ("split", "split", lambda: step_split(bench)),
        ("capture", "capture", lambda: capture_costs(bench)),
        ("serving", "serving", lambda: serving(bench)),
        ("moe", "moe", lambda: gpu_moe.moe(bench)),
        ("speed", "speed-1", lambda: speed(bench, 1)),
        ("eager", "eager-0", lambda: eager_speed(bench, 0)),
        ("eager", "eager-1", lambda: eager_speed(bench, 1)),
    ]
    for kind, name, fn in sections:
        if args.only and kind not in args.only:
            continue
        if bench.over():
            report["skipped"][name] = "time budget"
            print(f"\n== {name}: skipped (time budget)", flush=True)
            continue
        t0 = time.monotonic()
        print(f"\n[{t0 - started:.0f}s] {name}", flush=True)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others' figures
            traceback.print_exc()
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
        report.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)
        free(device)
        if args.json is not None:  # after every section: a run cut short keeps what it measured
            args.json.write_text(json.dumps(report, indent=2, default=str))
    bench.drop_graph_engine()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["targets"] = targets(report)
    print_targets(report["targets"], args.smoke)
    print(f"\nmeasured for {report['seconds']:.0f}s")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    status = 0
    if args.tests and not args.smoke:
        status = run_tests(args, report)
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2, default=str))
    if report["errors"]:
        print(f"\nsections that failed: {report['errors']}")
        status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
