"""What capturing hidden states costs: tapllm with and without capture, and against transformers.

What it measures
    Greedy generation on the default model (SmolLM2-135M-Instruct), random-token prompts of
    equal length, EOS ignored, so every request yields exactly ``--new-tokens`` tokens. One
    ``LLM`` runs five scenarios over the same prompts, each as one ``generate`` call timed end
    to end (prefill, decode, capture, copies to CPU, result assembly):

      (a) no request captures                          -- the baseline
      (b) ``final`` at the last prompt position only
      (c) the mean over the prompt of ``resid_pre`` at 3 blocks
      (d) ``resid_pre`` at 3 blocks, every position (prompt and generated)
      (e) ``resid_post`` of every block, every position
      (f) no capture; half the requests steered (a vector added at ``resid_post`` of 3 blocks)

    Scenarios run in rounds, the order rotated each round (a..e, b..a, ...) so slow drift of
    the machine does not favour one scenario; each scenario's best time is kept, because the
    machine is noisy (about +-15% run to run), and the ratios are to (a) of the same run (the
    ratio of medians is printed too).
    Because that noise is larger than the effect, it also times the capture work itself (the
    step tap's construction with its capture and steering plans, its calls at every point of
    the forward (steering in place, then recording rows), and the hand-off of rows to each
    request: projection, reduction, copies to CPU) and reports it as a share of the call.
    For (e) it reports the bytes captured and the rate at which the capture work moved them.

    Then transformers does (d)'s work: ``generate(output_hidden_states=True)`` on the same
    prompts (it returns every layer at every step; the same 3 blocks are then picked out
    into one ``[positions, 3, hidden]`` tensor per request, as tapllm returns them), and
    its throughput is compared with tapllm's (d). Peak memory is measured fairly in fresh
    subprocesses, one per engine, each loading its model and running (d) once: the kernel's
    RSS high-water mark (VmHWM) of that process.

How to run (from the repository root)
    python benchmarks/hidden_states.py             # batch 16, prompt 512, 128 new tokens, bf16
    python benchmarks/hidden_states.py --quick     # batch 4, prompt 128, 32 new tokens
    python benchmarks/hidden_states.py --rounds 5 --skip-hf
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rss import peak_rss_mib  # noqa: E402
from throughput import DTYPE_NAMES, REPO_ROOT, Config, build_hf, build_tapllm, make_prompts  # noqa: E402

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer  # noqa: E402
from tapllm.engine.step_tap import StepTap  # noqa: E402
from tapllm.loader import resolve_model  # noqa: E402


class CaptureTimer:
    """Accumulates the time spent in the step tap (construction, calls in the forward, finish).

    Installed by wrapping ``StepTap``'s methods for this benchmark only; the engine itself
    carries no timing code.
    """

    def __init__(self) -> None:
        self.seconds = 0.0

    def _wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def install(self) -> None:
        StepTap.build = classmethod(self._wrap(StepTap.build.__func__))  # builds both plans
        for name in ("__call__", "finish"):
            setattr(StepTap, name, self._wrap(getattr(StepTap, name)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_NAMES))
    p.add_argument("--rounds", type=int, default=3, help="times each scenario runs; the best counts")
    p.add_argument("--quick", action="store_true", help="batch 4, prompt 128, 32 new tokens, 1 round")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-probe", choices=["tapllm", "hf"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.prompt_len, args.new_tokens, args.rounds = 4, 128, 32, 1
    return args


def scenarios(num_layers: int, hidden: int, prompt_len: int) -> dict[str, HiddenStatesSpec | list[Steer] | None]:
    """The capture scenarios and the steering one; the 3 blocks are the second, the middle and the last."""
    three = [1, num_layers // 2, num_layers - 1]
    direction = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
    return {
        "a none": None,
        "b final@last_prompt": HiddenStatesSpec(layers=[0], points="final", positions="last_prompt"),
        "c mean(prompt) 3 blocks": HiddenStatesSpec(layers=three, points="resid_pre", positions="prompt",
                                                    reduce="mean"),
        "d 3 blocks every position": HiddenStatesSpec(layers=three, points="resid_pre", positions="all"),
        "e all blocks every position": HiddenStatesSpec(layers="all", points="resid_post", positions="all"),
        "f half the batch steered": [Steer(layers=three, point="resid_post", vector=direction, scale=0.5)],
        "g patterns 2 blocks, last 32": HiddenStatesSpec(layers=[1, num_layers - 1], points="attn_pattern",
                                                         positions=(max(0, prompt_len - 32), prompt_len)),
        "h lens top-5, all blocks": HiddenStatesSpec(layers="all", points="resid_post", positions="last_prompt",
                                                     lens=5),
    }


def run_tapllm(llm: LLM, prompts: list[list[int]], new: int, spec: HiddenStatesSpec | list[Steer] | None
               ) -> tuple[float, int, Any]:
    """One timed generate; returns (seconds, tokens, outputs).

    ``spec`` is what every request captures, or a list of steers applied to every other
    request (the steering scenario).
    """
    if isinstance(spec, list):
        steered = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, steering=spec)
        plain = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        params: Any = [steered if i % 2 == 0 else plain for i in range(len(prompts))]
    else:
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, hidden_states=spec)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), outs


def run_hf(model: Any, prompts: list[list[int]], new: int, layers: list[int]) -> tuple[float, int, list[torch.Tensor]]:
    """transformers ``generate(output_hidden_states=True)``, then the same [positions, 3, hidden] per request."""
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0, output_hidden_states=True, return_dict_in_generate=True,
        )
        # out.hidden_states[step][layer]: [batch, step tokens, hidden]; HF index i = resid_pre of block i
        per_layer = [torch.cat([step[i] for step in out.hidden_states], dim=1) for i in layers]
        states = torch.stack(per_layer, dim=2)  # [batch, positions, 3, hidden]
        result = [states[b].contiguous() for b in range(states.shape[0])]
    seconds = time.perf_counter() - t0
    return seconds, out.sequences[:, ids.shape[1]:].numel(), result


def toolkit_against_hf(folder: Path, model: Any, cfg: Config, num_layers: int, args: argparse.Namespace) -> None:
    """(i) a patching sweep in one batched call and (j) prompt logprobs, against transformers doing the same work.

    Fresh prompts (another seed) for each. A sweep runs as a researcher runs one: the clean and
    corrupted baselines first (their logit differences, the clean states), then every patch;
    tapllm keeps its prefix cache on with 4-token blocks, so each patched run recomputes only
    from the block holding its patch, and the whole sweep is one batched call.
    """
    from tapllm.config import EngineConfig

    llm = LLM(config=EngineConfig(dtype=DTYPE_NAMES[cfg.dtype], max_num_seqs=256, block_size=4,
                                  kv_cache_memory_gb=4.0, hidden_states_max_bytes_per_request=None))
    length, window = 32, 16
    clean, corrupted = make_prompts(2, length, 49152, args.seed + 101)
    a, b = 1234, 5678
    logits = HiddenStatesSpec(points="final", positions="last_prompt", lens=1, lens_targets=[a, b])
    patches = [(layer, pos) for layer in range(num_layers) for pos in range(length - window, length)]
    t0 = time.perf_counter()
    llm.generate([clean, corrupted], SamplingParams(max_tokens=1, temperature=0, hidden_states=logits),
                 use_tqdm=False)  # the baselines
    clean_hs = llm.encode([clean], dict(layers="all", points="resid_pre", positions="all"), use_tqdm=False)[0]
    params = [SamplingParams(max_tokens=1, temperature=0, hidden_states=logits, steering=[Steer(
        op="set", point="resid_pre", layers=[layer], positions=[pos], values=clean_hs.hidden_states)])
        for layer, pos in patches]
    outs = llm.generate([corrupted] * len(patches), params, use_tqdm=False)
    ours = time.perf_counter() - t0
    diffs = [float(o.hidden_states.lens.target_logprobs[0, 0, 0] - o.hidden_states.lens.target_logprobs[0, 0, 1])
             for o in outs]
    t0 = time.perf_counter()
    with torch.inference_mode():
        states = model(torch.tensor([clean]), output_hidden_states=True).hidden_states
        model(torch.tensor([corrupted]))  # the corrupted baseline
        theirs_diffs = []
        for layer, pos in patches:
            value = states[layer][0, pos]

            def hook(m, args_, kwargs, value=value, pos=pos):
                x = args_[0].clone()
                x[0, pos] = value
                return (x,) + tuple(args_[1:]), kwargs

            handle = model.model.layers[layer].register_forward_pre_hook(hook, with_kwargs=True)
            lp = model(torch.tensor([corrupted])).logits[0, -1].float().log_softmax(-1)
            handle.remove()
            theirs_diffs.append(float(lp[a] - lp[b]))
    theirs = time.perf_counter() - t0
    agree = max(abs(x - y) for x, y in zip(diffs, theirs_diffs))
    print(f"\n(i) patching sweep, {num_layers} blocks x {window} positions ({len(patches)} patched runs of a "
          f"{length}-token prompt): tapllm {ours:.2f} s in one call, transformers + hooks {theirs:.2f} s in a loop: "
          f"{theirs / ours:.1f}x faster (largest logit-difference disagreement {agree:.3g})")

    prompts = make_prompts(cfg.batch, cfg.prompt_len, 49152, args.seed + 202)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5), use_tqdm=False)
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), 4):
            ids = torch.tensor(prompts[i:i + 4])
            lp = model(ids).logits[:, :-1].float().log_softmax(-1)
            lp.gather(-1, ids[:, 1:, None])
            lp.topk(5, dim=-1)
    theirs = time.perf_counter() - t0
    n = sum(len(o.prompt_logprobs) for o in outs)
    print(f"(j) prompt logprobs (top 5), {cfg.batch} x {cfg.prompt_len} tokens: tapllm {ours:.2f} s, transformers "
          f"(batches of 4, log_softmax, gather, topk) {theirs:.2f} s: {theirs / ours:.1f}x ({n} positions)")
    del llm
    gc.collect()


def memory_probe(args: argparse.Namespace, folder: Path, cfg: Config, prompts: list[list[int]], three: list[int]) -> None:
    """Subprocess mode: load one engine, run (d) once, print its peak RSS as JSON."""
    if args.memory_probe == "tapllm":
        llm = build_tapllm(folder, cfg.dtype, [cfg])
        spec = HiddenStatesSpec(layers=three, points="resid_pre", positions="all")
        _, n, outs = run_tapllm(llm, prompts, args.new_tokens, spec)
        held = sum(o.hidden_states.nbytes for o in outs)
    else:
        _, n, outs = run_hf(build_hf(folder, cfg.dtype), prompts, args.new_tokens, three)
        held = sum(t.nbytes for t in outs)
    print(json.dumps({"peak_rss_mib": peak_rss_mib(), "tokens": n, "states_bytes": held}))


def probe_in_subprocess(engine: str, argv: list[str]) -> dict[str, Any]:
    """Run ``memory_probe`` for ``engine`` in a fresh interpreter."""
    cmd = [sys.executable, __file__, *argv, "--memory-probe", engine]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Run the scenarios and print the table."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    folder = resolve_model(None)
    cfg = Config(args.dtype, args.batch, args.prompt_len, args.new_tokens)
    num_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    three = [1, num_layers // 2, num_layers - 1]
    prompts = make_prompts(args.batch, args.prompt_len, 49152, args.seed)
    if args.memory_probe:
        memory_probe(args, folder, cfg, prompts, three)
        return
    print(f"hidden-state capture cost: default model, {cfg.name}, {args.rounds} round(s), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    llm = build_tapllm(folder, cfg.dtype, [cfg])
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    specs = scenarios(num_layers, hidden, args.prompt_len)
    names = list(specs)
    run_tapllm(llm, [p[:16] for p in prompts[:2]], 4, specs["d 3 blocks every position"])  # warm-up
    timer = CaptureTimer()
    timer.install()
    best: dict[str, float] = {}
    tokens: dict[str, int] = {}
    captured: dict[str, int] = {}
    capture_share: dict[str, float] = {}
    all_seconds: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            before = timer.seconds
            seconds, n, outs = run_tapllm(llm, prompts, args.new_tokens, specs[name])
            share = (timer.seconds - before) / seconds
            captured[name] = sum(o.hidden_states.nbytes for o in outs if o.hidden_states is not None)
            del outs
            all_seconds.setdefault(name, []).append(seconds)
            if seconds < best.get(name, float("inf")):
                best[name], capture_share[name] = seconds, share
            tokens[name] = n
            print(f"  round {r + 1} {name:30s} {n} tokens in {seconds:7.2f} s = {n / seconds:7.1f} tok/s "
                  f"(capture work {100 * share:.2f}%)", flush=True)
    del llm
    gc.collect()

    base = tokens["a none"] / best["a none"]
    med = {name: tokens[name] / statistics.median(s) for name, s in all_seconds.items()}
    print(f"\n{'scenario':30s} {'tok/s':>8s} {'vs (a)':>8s} {'median vs (a)':>14s} {'capture work':>13s} "
          f"{'captured':>10s}")
    for name in names:
        rate = tokens[name] / best[name]
        print(f"{name:30s} {rate:8.1f} {rate / base:7.3f}x {med[name] / med['a none']:13.3f}x "
              f"{100 * capture_share[name]:12.2f}% "
              f"{captured[name] / 1e6:8.1f} MB")
    e = "e all blocks every position"
    e_bytes, e_work = captured[e], capture_share[e] * best[e]
    print(f"(e) captured {e_bytes / 1e9:.3f} GB in {e_work:.2f} s of capture work = {e_bytes / 1e9 / e_work:.2f} GB/s; "
          f"{e_bytes / 1e9 / best[e]:.3f} GB/s over the whole call")

    if args.skip_hf:
        return
    model = build_hf(folder, args.dtype)
    toolkit_against_hf(folder, model, cfg, num_layers, args)
    run_hf(model, [p[:16] for p in prompts[:2]], 4, three)  # warm-up
    seconds, n, result = run_hf(model, prompts, args.new_tokens, three)
    del model, result
    gc.collect()
    hf_rate = n / seconds
    d_rate = tokens["d 3 blocks every position"] / best["d 3 blocks every position"]
    print("\n(d) against transformers generate(output_hidden_states=True), same prompts and blocks:")
    print(f"  transformers {n} tokens in {seconds:.2f} s = {hf_rate:.1f} tok/s")
    print(f"  tapllm (d)   {d_rate:.1f} tok/s: {d_rate / hf_rate:.2f}x transformers' throughput")
    mem = {engine: probe_in_subprocess(engine, argv) for engine in ("tapllm", "hf")}
    for engine, m in mem.items():
        if "error" in m:
            print(f"  peak RSS {engine}: probe failed: {m['error']}")
        else:
            print(f"  peak RSS {engine:6s} (fresh process, (d) once): {m['peak_rss_mib']:.0f} MiB, "
                  f"holding {m['states_bytes'] / 1e6:.1f} MB of states")
    if all("error" not in m for m in mem.values()):
        print(f"  tapllm peak / transformers peak = {mem['tapllm']['peak_rss_mib'] / mem['hf']['peak_rss_mib']:.2f}")


if __name__ == "__main__":
    main()
