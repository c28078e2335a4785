"""tapllm on one GPU in one command: speed against transformers and the weights' streaming time,
capture and steering costs, parity, memory and start-up; then the ``cuda`` tests.

What it measures (bf16 unless said; every figure in one run, so ratios are fair)
    1. The GPU's read bandwidth: a plain reduction over a 4 GB tensor (best of 5).
    2. Per model shape (random weights built from transformers configs: the Llama-3.2-1B and
       Llama-3.1-8B block shapes, the default tokenizer's 49,152-token vocabulary), for tapllm
       (CUDA graphs and Triton attention), tapllm ``enforce_eager=True`` (the PyTorch
       reference step) and transformers ``generate``: output tokens/s of greedy generation at
       batch 1, 16, 64 (and 256 for tapllm), prompts of 128 random tokens, 64 new tokens,
       EOS ignored, best of 2 runs with fresh prompts each; start-up time (the engine's
       constructor: weights, KV cache, graph capture) and peak GPU memory.
    3. The batch-1 decode step (from two generations of 1 and 65 tokens) against its bound:
       the weights' bytes over the measured bandwidth.
    4. What capture and steering cost on the 1B shape at batch 16 (tapllm, graphs on): the
       last position's final state, a mean over the prompt at 3 blocks, 3 blocks at every
       position, every block at every position, half the batch steered at 3 blocks, and an
       SAE's top-16 features at one block; each as a share of the plain run's throughput.
    5. Parity in float32 on a small model: greedy tokens and every block's residual stream
       against transformers' ``output_hidden_states`` on the same GPU, graph and eager paths.
    Then ``pytest -m cuda`` (every family's CUDA tests), unless ``--skip-tests``.

How to run
    python benchmarks/gpu.py                       # on a CUDA machine; about 8 minutes
    python benchmarks/gpu.py --smoke               # the same script on CPU, tiny shapes, < 2 minutes
    python benchmarks/gpu.py --prepare .gpu        # here: the tokenizer, for a machine without the model
    python benchmarks/gpu.py --tokenizer .gpu/tokenizer --json $OUT/gpu.json

The JSON (``--json``) holds every figure printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VOCAB = 49152
FIRST_TOKEN_ID = 100  # away from the special tokens


# ---- shapes -------------------------------------------------------------------------------
def model_configs(smoke: bool) -> dict[str, Any]:
    """name -> a transformers ``LlamaConfig`` of that shape (random weights are made from it)."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if smoke:
        rope = {**rope, "original_max_position_embeddings": 256}
        return {
            "tiny-a": LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                                  max_position_embeddings=1024, rope_parameters=rope),
            "tiny-b": LlamaConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=256, tie_word_embeddings=False,
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


def model_folder(root: Path, name: str, config: Any, tokenizer: Path) -> Path:
    """A folder with the shape's ``config.json`` and the tokenizer: what ``load_format="dummy"`` reads."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    config.architectures = ["LlamaForCausalLM"]
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
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


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


# ---- engines --------------------------------------------------------------------------------
def tapllm_engine(folder: Path, device: torch.device, *, eager: bool, dtype: str, max_batch: int,
                  kv_gb: float) -> tuple[Any, float]:
    """tapllm with random weights of ``folder``'s shape; returns (LLM, start-up seconds)."""
    from tapllm import LLM

    start, llm = timed(device, lambda: LLM(
        folder, dtype=dtype, device=str(device), load_format="dummy", enforce_eager=eager, max_num_seqs=max_batch,
        max_num_batched_tokens=max(2048, 128 * min(max_batch, 64)), max_model_len=1024, kv_cache_memory_gb=kv_gb,
        enable_prefix_caching=False))
    return llm, start


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
    """One batch-1 decode step: (``steps + 1`` tokens - 1 token) / ``steps``, best of ``runs``."""
    from tapllm import SamplingParams

    def run(n: int, r: int) -> float:
        p = prompts(1, prompt_len, f"{seed}-step{n}-{r}")
        return timed(device, lambda: llm.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                                  use_tqdm=False))[0]

    one = min(run(1, r) for r in range(runs))
    many = min(run(steps + 1, r) for r in range(runs))
    return max(many - one, 0.0) / steps * 1e3


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


# ---- sections -------------------------------------------------------------------------------
def speed(args: argparse.Namespace, device: torch.device, root: Path, tokenizer: Path, bw: float,
          report: dict[str, Any], which: int) -> None:
    """Section 2-3 for the ``which``-th model shape."""
    new, plen = args.new_tokens, args.prompt_len
    for name, config in list(model_configs(args.smoke).items())[which:which + 1]:
        folder = model_folder(root, name, config, tokenizer)
        rows: dict[str, Any] = {}
        for engine in ("tapllm", "tapllm-eager"):
            if args.deadline and time.monotonic() > args.deadline:
                rows[engine] = {"skipped": "time budget"}
                continue
            reset_peak(device)
            batches = args.batches if engine == "tapllm" else [b for b in args.batches if b <= 64]
            llm, start = tapllm_engine(folder, device, eager=engine == "tapllm-eager", dtype=args.dtype,
                                       max_batch=max(batches), kv_gb=args.kv_gb)
            row = {"startup_s": round(start, 2), "describe": llm.describe()}
            graphs = llm.engine.runner.graphs
            if graphs is not None:
                row["graph_capture_s"] = round(graphs.capture_seconds, 2)
            print(f"\n{engine} on {name}, started in {start:.1f}s:\n{llm.describe()}", flush=True)
            tapllm_rate(llm, device, min(4, max(batches)), 4, plen, f"{name}-warm")  # first launches out of the timing
            for b in batches:
                row[f"b{b}"] = round(tapllm_rate(llm, device, b, new, plen, f"{name}-{engine}", args.runs), 1)
            step = decode_step_ms(llm, device, plen, f"{name}-{engine}", args.step_tokens, args.runs + 1)
            bound = weight_bytes(llm) / (bw * 1e9) * 1e3
            row.update(step_ms=round(step, 3), bound_ms=round(bound, 3), step_over_bound=round(step / bound, 2),
                       weights_gb=round(weight_bytes(llm) / 1e9, 3), peak_gpu_gb=peak_memory_gb(device))
            rows[engine] = row
            del llm
            free(device)
        if not args.skip_hf and not (args.deadline and time.monotonic() > args.deadline):
            reset_peak(device)
            model = hf_model(config, device, getattr(torch, {"bf16": "bfloat16"}.get(args.dtype, args.dtype)))
            row = {}
            for b in [b for b in args.batches if b <= args.hf_max_batch]:
                row[f"b{b}"] = round(hf_rate(model, device, b, new, plen, name, args.runs), 1)
            row["peak_gpu_gb"] = peak_memory_gb(device)
            rows["transformers"] = row
            del model
            free(device)
        hf = rows.get("transformers", {})
        for engine in ("tapllm", "tapllm-eager"):
            for b in args.batches:
                if f"b{b}" in hf and f"b{b}" in rows.get(engine, {}):
                    rows[engine][f"b{b}_vs_transformers"] = round(rows[engine][f"b{b}"] / hf[f"b{b}"], 2)
        report["models"][name] = rows
        print_model(name, rows, args.batches)


def print_model(name: str, rows: dict[str, Any], batches: list[int]) -> None:
    print(f"\n== {name}: output tokens/s (prompt 128, 64 new, greedy), and vs transformers")
    print(f"{'engine':14s}" + "".join(f"{'b' + str(b):>16s}" for b in batches) + f"{'step ms':>10s}{'/bound':>8s}"
          f"{'start s':>9s}{'peak GB':>9s}")
    for engine, row in rows.items():
        if "skipped" in row:
            print(f"{engine:14s} skipped ({row['skipped']})")
            continue
        cells = ""
        for b in batches:
            v = row.get(f"b{b}")
            r = row.get(f"b{b}_vs_transformers")
            cells += f"{(f'{v:,.0f}' + (f' ({r:.2f}x)' if r else '')) if v else '-':>16s}"
        step = f"{row['step_ms']:>10.2f}{row['step_over_bound']:>8.2f}" if "step_ms" in row else f"{'':>18s}"
        start = f"{row['startup_s']:>9.1f}" if "startup_s" in row else f"{'':>9s}"
        peak = f"{row['peak_gpu_gb']:>9.1f}" if row.get("peak_gpu_gb") is not None else f"{'':>9s}"
        print(f"{engine:14s}{cells}{step}{start}{peak}")


def capture_costs(args: argparse.Namespace, device: torch.device, root: Path, tokenizer: Path,
                  report: dict[str, Any]) -> None:
    from tapllm import HiddenStatesSpec, SamplingParams, Steer
    from tapllm.sae.sae_config import SAEConfig
    from tapllm.sae.model import SAE

    name, config = next(iter(model_configs(args.smoke).items()))
    folder = model_folder(root, name, config, tokenizer)
    batch, new, plen = args.capture_batch, args.new_tokens, args.prompt_len
    llm, _ = tapllm_engine(folder, device, eager=False, dtype=args.dtype, max_batch=batch, kv_gb=args.kv_gb)
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
    for r in range(args.runs):
        for label, spec in cases.items():
            if args.deadline and time.monotonic() > args.deadline:
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
    rows = {label: {"tok_s": round(v, 1), "cost_pct": round(100 * (1 - v / base), 1) if base else None}
            for label, v in best.items()}
    graphs = llm.engine.runner.graphs
    fallbacks = dict(graphs.fallbacks) if graphs is not None else {}
    report["capture"] = {"model": name, "batch": batch, "cases": rows, "eager_fallbacks": fallbacks}
    print(f"\n== capture and steering on {name}, batch {batch} (cost = share of the plain run's throughput)")
    for label, row in rows.items():
        cost = f"{row['cost_pct']:+.1f}%" if row["cost_pct"] is not None else ""
        print(f"  {label:34s}{row['tok_s']:>12,.0f} tok/s  {cost}")
    if fallbacks:
        print(f"  steps that could not replay a graph: {fallbacks}")
    del llm
    free(device)


def parity(args: argparse.Namespace, device: torch.device, root: Path, tokenizer: Path,
           report: dict[str, Any]) -> None:
    """float32: greedy tokens and every block's resid_pre against transformers on the same device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tapllm import LLM, HiddenStatesSpec, SamplingParams

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=2048,
                         initializer_range=0.2, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                                 "factor": 8.0, "low_freq_factor": 1.0,
                                                                 "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 256})
    torch.manual_seed(0)
    folder = model_folder(root, "parity", config, tokenizer)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    ps = prompts(4, 40, "parity") + prompts(2, 60 if args.smoke else 300, "parity-long")
    new = 8
    spec = HiddenStatesSpec(layers="all", points="resid_pre", positions="all")
    result: dict[str, Any] = {}
    for engine in ("tapllm", "tapllm-eager"):
        llm = LLM(folder, dtype="float32", device=str(device), enforce_eager=engine == "tapllm-eager")
        outs = llm.generate(ps, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, hidden_states=spec),
                            use_tqdm=False)
        same_tokens, worst = 0, 0.0
        for p, out in zip(ps, outs):
            ids = torch.tensor([p], device=device)
            with torch.inference_mode():
                ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                seq = torch.tensor([(p + out.outputs[0].token_ids)[:-1]], device=device)
                states = hf(seq, output_hidden_states=True).hidden_states
            same_tokens += ref == out.outputs[0].token_ids
            want = torch.stack([states[i][0] for i in range(config.num_hidden_layers)], 1).float().cpu()
            got = out.hidden_states["resid_pre"].float()
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        result[engine] = {"tokens_equal": f"{same_tokens}/{len(ps)}", "max_rel_state_error": worst}
        del llm
        free(device)
    report["parity"] = result
    print("\n== parity (float32, 4 blocks, every position) against transformers on the same device")
    for engine, r in result.items():
        print(f"  {engine:14s} greedy tokens equal {r['tokens_equal']}, states within {r['max_rel_state_error']:.1e} "
              "of the largest value")


def run_tests(args: argparse.Namespace, report: dict[str, Any]) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(REPO_ROOT / "tests")]
    print(f"\n== the cuda tests: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, timeout=args.test_timeout)
    report["cuda_tests"] = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    return proc.returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script itself")
    p.add_argument("--prepare", type=Path, help="write the tokenizer files for a GPU machine into this folder, then exit")
    p.add_argument("--tokenizer", type=Path, help="a folder with the default tokenizer's files (default: the model's)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--hf-max-batch", type=int, default=64, help="largest batch transformers runs")
    p.add_argument("--capture-batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-gb", type=float, default=16.0, help="KV cache per engine (GB)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds before later sections are skipped")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--only", choices=["speed", "capture", "parity"], action="append",
                   help="run only these sections (repeatable)")
    p.add_argument("--test-timeout", type=int, default=600)
    args = p.parse_args(argv)
    if args.batches is None:
        args.batches = [1, 4] if args.smoke else [1, 16, 64, 256]
    args.runs, args.step_tokens = 2, 64
    if args.smoke:
        args.prompt_len, args.new_tokens, args.kv_gb, args.capture_batch = 16, 4, 0.05, 4
        args.runs, args.step_tokens = 1, 8
        args.hf_max_batch = min(args.hf_max_batch, 4)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare is not None:
        prepare(args.prepare)
        return 0
    if args.smoke:
        device = torch.device("cpu")
        args.dtype = "float32"
    elif not torch.cuda.is_available():
        print("no CUDA GPU here: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    args.deadline = time.monotonic() + args.budget if args.budget else None
    tokenizer = args.tokenizer or default_tokenizer()
    root = Path(os.environ.get("TAPLLM_GPU_BENCH_DIR", "/tmp/tapllm-gpu-bench"))
    root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "dtype": args.dtype, "models": {}, "errors": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    print(f"tapllm GPU check on {report['device']} (torch {report['torch']}, triton {report['triton']}, "
          f"{args.dtype})", flush=True)
    bw = bandwidth_gbs(device, 64e6 if args.smoke else 4e9)
    report["bandwidth_gbs"] = round(bw, 1)
    print(f"read bandwidth: {bw:,.0f} GB/s")
    # the first shape's speed, capture, parity, then the larger shape: the most telling figures first
    sections = [("speed", "speed-0", lambda: speed(args, device, root, tokenizer, bw, report, 0)),
                ("capture", "capture", lambda: capture_costs(args, device, root, tokenizer, report)),
                ("parity", "parity", lambda: parity(args, device, root, tokenizer, report)),
                ("speed", "speed-1", lambda: speed(args, device, root, tokenizer, bw, report, 1))]
    for kind, name, fn in sections:
        if args.only and kind not in args.only:
            continue
        if args.deadline and time.monotonic() > args.deadline:
            report["errors"][name] = "skipped: time budget"
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others' figures
            traceback.print_exc()
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
        free(device)
        if args.json is not None:  # after every section: a run cut short keeps what it measured
            args.json.write_text(json.dumps(report, indent=2, default=str))
    status = 0
    if not args.skip_tests and not args.smoke:
        status = run_tests(args, report)
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2, default=str))
    if report["errors"]:
        print(f"\nsections that failed: {report['errors']}")
        status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
