"""Decode-step time with and without vLLM's sampling controls (penalties, bias, bans) at a fixed batch.

Runs the engine directly: a batch of prompts is prefilled, then decode steps are timed, and the
share of each step spent in ``sample`` is timed too. Cases: no controls (the common path, which
must not slow down), penalties on every row, and every control on every row. Run it against
another checkout (``PYTHONPATH=that/checkout``) to compare; cases a checkout lacks are skipped.

    python benchmarks/sampling_controls.py [--model PATH] [--batch 16] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tapllm.engine.model_runner as model_runner
from tapllm import LLM, SamplingParams

CASES = {
    "none (greedy)": dict(temperature=0),
    "none (sampled)": dict(temperature=1.0, seed=1),
    "penalties (greedy)": dict(temperature=0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
    "all controls (greedy)": dict(temperature=0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                                  logit_bias={i: 1.0 for i in range(100, 120)}, bad_words=["the", "an apple"],
                                  min_tokens=10),
}


def _time_case(llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int, sample_times: list[float]
               ) -> tuple[float, float]:
    engine = llm.engine
    reqs = [engine.add(engine.input_processor.prepare(p, params)) for p in prompts]
    engine.step()  # prefill
    engine.step()
    step_times = []
    sample_times.clear()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    for r in reqs:
        engine.abort(r.request_id)
    return statistics.median(step_times) * 1e3, statistics.median(sample_times[-steps:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.manual_seed(0)
    llm = LLM(args.model, dtype=args.dtype)
    sample_times: list[float] = []
    original = model_runner.sample

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = original(*a, **kw)
        sample_times.append(time.perf_counter() - t0)
        return out

    model_runner.sample = timed
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len,)).tolist() for _ in range(args.batch)]
    print(f"batch {args.batch}, {args.steps} decode steps, vocab {vocab}, median ms")
    print(f"{'case':<24}{'step':>10}{'sample':>10}")
    for name, kw in CASES.items():
        try:
            params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, **kw)
        except TypeError:
            print(f"{name:<24}{'(not in this checkout)':>20}")
            continue
        _time_case(llm, prompts, params, 5, sample_times)  # warm up
        step, sample = _time_case(llm, prompts, params, args.steps, sample_times)
        print(f"{name:<24}{step:>10.2f}{sample:>10.3f}")


if __name__ == "__main__":
    main()
