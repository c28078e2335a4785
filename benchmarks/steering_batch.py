"""Steered and unsteered greedy requests in random batches, each compared with itself run alone.

What it measures
    One in-process engine (the default model in its default dtype, bfloat16 on a CPU with
    native bf16). Each trial runs a batch of 2-8 requests that arrive at random steps (so decode
    steps mix with other requests' prefill chunks); about three quarters steer (one of a menu:
    adds, several adds at one point, ablate, clamp, scale, set, head and neuron points, k/v,
    resid_mid, generated positions only), the rest do not. Every request of every trial is
    compared with the same request run alone on the same engine: its tokens, and its ``final``
    states at every position in the model's dtype, bitwise (capturing ``final`` taps no block,
    so it changes no request's route). It prints, for steered and for unsteered requests, how
    many differed in tokens and in states.

    ``--max-num-batched-tokens 64`` (the default here) keeps every step within the rows where the
    linears' row results do not depend on the batch (the packed GEMV's range); a larger budget
    lets prefill steps run oneDNN's GEMM, whose rows round differently from the GEMV's, for
    every request alike (that is batch invariance in general, not steering).

How to run (from the repository root)
    python benchmarks/steering_batch.py                        # 200 steered requests
    python benchmarks/steering_batch.py --steered 50 --max-num-batched-tokens 2048
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer

QUESTIONS = [
    "Tell me about your day.", "What is the capital of France?", "Write a poem about pizza.",
    "Explain gravity to a child.", "How do birds fly?", "Why is the sky blue?", "Give me a recipe for pasta.",
    "What is a black hole?", "Describe a forest at night.", "Tell me a joke about cats.",
]
FINAL = HiddenStatesSpec(points="final", positions="all")


def steer_menu(hidden: int, head_dim: int, seed: int = 0) -> dict[str, Callable[[], list[Steer]]]:
    """Named steering mixes, each built from fixed random directions."""
    g = torch.Generator().manual_seed(seed)

    def vec(n: int = hidden, norm: float = 1.0) -> torch.Tensor:
        v = torch.randn(n, generator=g)
        return v * (norm / v.norm())

    a, b, c, d, e = (vec() for _ in range(5))
    h1, h2 = vec(head_dim, 2.0), vec(head_dim, 1.0)
    values = torch.randn(2, hidden, generator=g)
    mixes = {
        "add": [Steer(layers=[10, 12], point="resid_post", op="add", vector=a, scale=8.0)],
        "add strong": [Steer(layers=[4, 20], point="resid_pre", op="add", vector=b, scale=30.0)],
        "two adds at a point": [Steer(layers=[8, 14], point="resid_post", op="add", vector=a, scale=6.0),
                                Steer(layers=[8], point="resid_post", op="add", vector=c, scale=-5.0)],
        "three adds, windows": [Steer(layers=[9], point="mlp_out", op="add", vector=d, scale=4.0),
                                Steer(layers=[9], point="mlp_out", op="add", vector=e, scale=3.0, positions="prompt"),
                                Steer(layers=[9], point="mlp_out", op="add", vector=a, scale=2.0,
                                      positions="generated")],
        "head adds": [Steer(layers=[7], point="z", op="add", vector=h1, heads=[1, 4]),
                      Steer(layers=[7], point="z", op="add", vector=h2)],
        "add then ablate": [Steer(layers=[8], point="resid_post", op="add", vector=b, scale=6.0),
                            Steer(layers=[8], point="resid_post", op="ablate", vector=c)],
        "ablate attn_out": [Steer(layers=[8, 9], point="attn_out", op="ablate", vector=d)],
        "clamp resid_mid": [Steer(layers=[9], point="resid_mid", op="clamp", vector=e, value=4.0)],
        "scale mlp_out": [Steer(layers=[6], point="mlp_out", op="scale", scale=1.6)],
        "neurons": [Steer(layers=[13], point="mlp_post", op="add", vector=torch.tensor([3.0, -2.0, 4.0]),
                          neurons=[5, 100, 900])],
        "k and v": [Steer(layers=[11], point="k", op="add", vector=h1),
                    Steer(layers=[11], point="v", op="scale", scale=1.4, heads=[0])],
        "generated only": [Steer(layers=[14], point="resid_post", op="add", vector=c, scale=10.0,
                                 positions="generated")],
        "set": [Steer(layers=[2], point="resid_post", op="set", positions=[1, 3], values=values)],
    }
    return {name: (lambda m=m: m) for name, m in mixes.items()}


def run_batch(llm: LLM, reqs: list[tuple[list[int], SamplingParams, int]]) -> list:
    """Run ``(prompt ids, params, arrival step)`` requests on the engine; outputs in the same order."""
    engine = llm.engine
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    added: dict[int, object] = {}
    step = 0
    while order or engine.has_unfinished_requests():
        while order and reqs[order[0]][2] <= step:
            i = order.pop(0)
            added[i] = engine.add(engine.input_processor.prepare(reqs[i][0], reqs[i][1]))
        if engine.has_unfinished_requests():
            engine.step()
        step += 1
    return [engine.make_output(added[i]) for i in range(len(reqs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steered", type=int, default=200, help="steered requests to compare (unsteered come on top)")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, enforce_eager=args.enforce_eager,
              max_num_batched_tokens=args.max_num_batched_tokens)
    cfg = llm.engine.model_config
    menu = steer_menu(cfg.hidden_size, cfg.head_dim, args.seed)
    names = list(menu)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in QUESTIONS]

    def params(name: str | None) -> SamplingParams:
        return SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, hidden_states=FINAL,
                              steering=menu[name]() if name else None)

    rng = random.Random(args.seed)
    alone: dict[tuple[int, str | None], object] = {}
    counts = {"steered": [0, 0, 0], "unsteered": [0, 0, 0]}  # requests, token mismatches, state mismatches
    per_mix: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while counts["steered"][0] < args.steered:
        batch = [(rng.randrange(len(prompts)), rng.choice(names) if rng.random() < 0.75 else None,
                  rng.choice([0, 0, 1, 2, 4, 6])) for _ in range(rng.choice([2, 3, 4, 6, 8]))]
        for p, name, _ in batch:
            if (p, name) not in alone:
                alone[(p, name)] = run_batch(llm, [(prompts[p], params(name), 0)])[0]
        outs = run_batch(llm, [(prompts[p], params(name), at) for p, name, at in batch])
        for (p, name, _), out in zip(batch, outs):
            ref = alone[(p, name)]
            tokens = out.outputs[0].token_ids != ref.outputs[0].token_ids
            states = not torch.equal(out.hidden_states["final"], ref.hidden_states["final"])
            c = counts["steered" if name else "unsteered"]
            c[0] += 1
            c[1] += tokens
            c[2] += states
            m = per_mix.setdefault(name or "(none)", [0, 0, 0])
            m[0] += 1
            m[1] += tokens
            m[2] += states
    took = time.perf_counter() - t0
    print(f"{llm.engine.model_config.dtype}, max_num_batched_tokens={args.max_num_batched_tokens}, "
          f"{'eager' if args.enforce_eager else 'default'} path, {args.new_tokens} new tokens, {took:.0f} s")
    print(f"{'requests':<22} {'n':>5} {'tokens differ':>14} {'states differ':>14}")
    for kind, (n, tokens, states) in counts.items():
        print(f"{kind:<22} {n:>5} {tokens:>14} {states:>14}")
    print("by steering mix:")
    for name, (n, tokens, states) in sorted(per_mix.items()):
        print(f"  {name:<20} {n:>5} {tokens:>14} {states:>14}")


if __name__ == "__main__":
    main()
