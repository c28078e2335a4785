"""A steered request's result does not depend on its neighbours any more than an unsteered one's does.

The default model in bfloat16, where a rounding difference anywhere shows in the states and
soon in greedy tokens: steered and unsteered requests run alone, then in batches with
neighbours that change how the step runs around them (arriving late, so decodes share steps
with prefill chunks; steering the same point with ops that do or do not merge with theirs;
steering ``resid_mid`` or ``k``; capturing every block, so no block of the step runs as one C++
call; a token budget that chunks prompts). The steps stay within 64 rows, where the linears'
row results do not depend on the number of rows.
"""

from __future__ import annotations

import pytest
import torch

from helpers import greedy
from tapllm import LLM, HiddenStatesSpec, RequestOutput, SamplingParams, Steer

NEW = 8
FINAL = HiddenStatesSpec(points="final", positions="all")  # taps no block: changes no request's route


def _vec(seed: int, n: int = 576, norm: float = 1.0) -> torch.Tensor:
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return v * (norm / v.norm())


TARGETS: dict[str, list[Steer] | None] = {
    "two adds at a point": [Steer(layers=[8, 14], point="resid_post", vector=_vec(1), scale=6.0),
                            Steer(layers=[8], point="resid_post", vector=_vec(2), scale=-5.0),
                            Steer(layers=[8], point="resid_post", vector=_vec(3), scale=4.0, positions="generated")],
    "head adds, ablate": [Steer(layers=[7], point="z", vector=_vec(4, 64, 2.0), heads=[1, 4]),
                          Steer(layers=[7], point="z", vector=_vec(5, 64)),
                          Steer(layers=[9], point="attn_out", op="ablate", vector=_vec(6))],
    "clamp, scale, neurons": [Steer(layers=[9], point="resid_mid", op="clamp", vector=_vec(7), value=4.0),
                              Steer(layers=[6], point="mlp_out", op="scale", scale=1.6),
                              Steer(layers=[13], point="mlp_post", vector=torch.tensor([3.0, -2.0, 4.0]),
                                    neurons=[5, 100, 900])],
    "plain": None,
    "plain too": None,
}
NEIGHBOURS: dict[str, dict] = {
    "ablates at 8": dict(steering=[Steer(layers=[8], point="resid_post", op="ablate", vector=_vec(8))]),
    "adds at 8": dict(steering=[Steer(layers=[8, 20], point="resid_post", vector=_vec(9), scale=3.0)]),
    "steers mid and k": dict(steering=[Steer(layers=[9], point="resid_mid", vector=_vec(10), scale=3.0),
                                       Steer(layers=[11], point="k", op="scale", scale=1.3)]),
    "captures every block": dict(hidden_states=HiddenStatesSpec(layers="all", points="resid_post", positions="last")),
    "plain": {},
}
PROMPTS = {
    "two adds at a point": "Tell me about your day.",
    "head adds, ablate": "Write a short poem about the sea and the wind.",
    "clamp, scale, neurons": "What is the capital of France?",
    "plain": "Why is the sky blue? Explain it simply.",
    "plain too": "List three fruits.",
}
# (request, arrival step): targets by name, neighbours as "+name" with their prompt
BATCHES = [
    [("two adds at a point", 0), ("plain", 0), ("+ablates at 8", 2), ("head adds, ablate", 3)],
    [("plain too", 0), ("clamp, scale, neurons", 0), ("+adds at 8", 1), ("two adds at a point", 4),
     ("+captures every block", 2)],
    [("head adds, ablate", 0), ("+steers mid and k", 0), ("clamp, scale, neurons", 1), ("plain", 0),
     ("+ablates at 8", 0), ("two adds at a point", 5), ("plain too", 3), ("+plain", 6)],
]


def _run(llm: LLM, reqs: list[tuple[list[int], SamplingParams, int]]) -> tuple[list[RequestOutput], set[str]]:
    """``(prompt ids, params, arrival step)`` run on one engine, each added at its step: the outputs in
    order, and the paths the steps' runs of blocks took (``CausalLM.last_runs``)."""
    engine = llm.engine
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    added, step, paths = {}, 0, set()
    while order or engine.has_unfinished_requests():
        while order and reqs[order[0]][2] <= step:
            i = order.pop(0)
            added[i] = engine.add(engine.input_processor.prepare(reqs[i][0], reqs[i][1]))
        if engine.has_unfinished_requests():
            engine.step()
            paths.update(path for _, _, path in engine.runner.model.last_runs)
        step += 1
    return [engine.make_output(added[i]) for i in range(len(reqs))], paths


def _error(a: RequestOutput, b: RequestOutput) -> float:
    """How far b's ``final`` states are from a's, relative to their scale (0.0: bitwise equal)."""
    x, y = a.hidden_states["final"].float(), b.hidden_states["final"].float()
    return float((x - y).abs().max() / x.abs().max())


@pytest.mark.slow
def test_steered_requests_batch_like_unsteered_ones(default_model_folder):
    """Each target alone, then in three batches: the unsteered targets give the floor (bitwise on a CPU
    with native bf16), the steered ones must reach it, tokens and ``final`` states."""
    # a budget of 48 tokens chunks the prompts and keeps every step within the GEMV's 64 rows
    llm = LLM(default_model_folder, dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=48)
    tok = llm.tokenizer
    ids = {name: tok.encode(text) for name, text in PROMPTS.items()}
    neighbour_ids = tok.encode("Once upon a time, in a land far away, there lived a dragon who")

    def params(name: str) -> SamplingParams:
        if name.startswith("+"):
            return greedy(NEW, **NEIGHBOURS[name[1:]])
        return greedy(NEW, steering=TARGETS[name], hidden_states=FINAL)

    alone = {name: _run(llm, [(ids[name], params(name), 0)])[0][0] for name in TARGETS}
    paths = set()
    results: dict[str, list[tuple[float, bool]]] = {name: [] for name in TARGETS}
    for batch in BATCHES:
        reqs = [(neighbour_ids if name.startswith("+") else ids[name], params(name), at) for name, at in batch]
        outs, seen = _run(llm, reqs)
        paths |= seen
        for (name, _), out in zip(batch, outs):
            assert out.error is None, out.error
            if not name.startswith("+"):
                same_tokens = out.outputs[0].token_ids == alone[name].outputs[0].token_ids
                results[name].append((_error(alone[name], out), same_tokens))

    unsteered = [r for name, rs in results.items() if TARGETS[name] is None for r in rs]
    floor = max(err for err, _ in unsteered)  # how close batching leaves an unsteered request's states
    # Where the GEMV takes fewer rows than these steps hold (an AMX CPU: 2), oneDNN's calls round each row
    # by the step's shape, so a request's states may move one bf16 rounding more or less than another's.
    slack = 0.0 if llm.engine.runner.backend.gemv_rows >= 48 else 2.0**-8
    for name, rs in results.items():
        for k, (err, same_tokens) in enumerate(rs):
            assert err <= floor + slack, \
                f"{name} (its batch {k}): states {err:.3g} from alone, unsteered ones {floor:.3g}"
            if all(same for _, same in unsteered):
                assert same_tokens, f"{name} (its batch {k}): tokens differ from alone"
    if llm.engine.runner.model.stack is not None:  # the fused CPU path: both routes were taken
        assert {"stack", "fused"} <= paths, paths
