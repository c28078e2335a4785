"""The host a step ahead of the device gives exactly what the synchronous step gives.

The CUDA backend runs on the CPU here (``backend="cuda"``: Triton's interpreter, graphs emulated), with
``async_scheduling=True``: each step is scheduled and launched before the previous one's tokens are
taken, its rows reading the pending tokens on the device; stops take effect a step late and the
row computed past a stop is dropped, captures included.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.kernels import triton_tap

pytestmark = pytest.mark.skipif(not triton_tap.available(torch.device("cpu")),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def _llm(folder, ahead: bool, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(folder, dtype="float32", backend="cuda", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
               cuda_graph_token_sizes=[16, 32, 64], async_scheduling=ahead, **kw)


def _same(want, got, exact: bool = True) -> None:
    """Same tokens and text; the same states (exactly when the batches were the same, else within 1e-5 of
    their scale: a batch of another shape rounds its matmuls differently in float32)."""
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.request_id
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.outputs[0].text == b.outputs[0].text
        if a.hidden_states is not None:
            assert a.hidden_states.positions.tolist() == b.hidden_states.positions.tolist()
            for point in a.hidden_states.points:
                x, y = a.hidden_states[point], b.hidden_states[point]
                tol = 0 if exact else 1e-5 * max(1.0, float(x.abs().max()))
                torch.testing.assert_close(x, y, rtol=0, atol=tol)


def test_a_step_ahead_equals_the_synchronous_step(tiny_models):
    folder = tiny_models["llama"]
    sync, ahead = _llm(folder, False), _llm(folder, True)
    assert sync.engine.loop.ahead is False and ahead.engine.loop.ahead is True
    prompts = random_prompts([5, 12, 3, 20, 9, 7], seed=21)
    hidden = sync.engine.model_config.hidden_size
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(2)) * 3

    def params(stops: list[list[int]] | None = None) -> list[SamplingParams]:
        stop = stops or [[]] * 6
        return [
            SamplingParams(max_tokens=9, temperature=0, stop_token_ids=stop[0]),
            SamplingParams(max_tokens=8, temperature=0.8, seed=3, stop_token_ids=stop[1],
                           hidden_states=HiddenStatesSpec(layers=[0, 2], points="resid_post", positions="all")),
            SamplingParams(max_tokens=10, temperature=0, stop_token_ids=stop[2],
                           hidden_states=HiddenStatesSpec(layers="all", points="mlp_out", positions="generated",
                                                          reduce="mean")),
            SamplingParams(max_tokens=7, temperature=0, stop_token_ids=stop[3],
                           steering=[Steer(layers=[1], point="resid_post", vector=v)],
                           hidden_states=HiddenStatesSpec(points="final", positions="last")),
            SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=9, stop_token_ids=stop[4]),
            SamplingParams(max_tokens=1, temperature=0, stop_token_ids=stop[5]),
        ]

    free = sync.generate(prompts, params(), use_tqdm=False)
    # Stop each request at a token it really produces (its third), so stops land mid-run.
    stops = [[o.outputs[0].token_ids[min(2, len(o.outputs[0].token_ids) - 1)]] for o in free]
    want = sync.generate(prompts, params(stops), use_tqdm=False)
    assert any(o.outputs[0].finish_reason == "stop" for o in want)
    got = ahead.generate(prompts, params(stops), use_tqdm=False)
    _same(want, got)
    _same(free, ahead.generate(prompts, params(), use_tqdm=False))
    assert ahead.engine.runner.policy.graph_steps > 0 and not ahead.engine.loop.busy()


def test_what_needs_the_tokens_on_the_host_waits_for_them(tiny_models):
    """Logprobs (the sampling plan), n > 1 (forks) and preemption, with the host a step ahead."""
    folder = tiny_models["llama"]
    prompts = random_prompts([18, 16, 20, 17], seed=22)
    params = [SamplingParams(max_tokens=10, temperature=0, logprobs=2),
              SamplingParams(max_tokens=8, temperature=0.9, seed=4, n=2),
              SamplingParams(max_tokens=12, temperature=0,
                             hidden_states=HiddenStatesSpec(layers=[1], points="resid_pre", positions="all")),
              SamplingParams(max_tokens=9, temperature=0)]
    small = dict(kv_cache_blocks=8, block_size=8)
    want = _llm(folder, False, **small).generate(prompts, params, use_tqdm=False)
    ahead = _llm(folder, True, **small)
    got = ahead.generate(prompts, params, use_tqdm=False)
    assert ahead.engine.scheduler.num_preemptions > 0
    for a, b in zip(want, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    _same(want, got, exact=False)  # preemption and forks can fall in other steps

    lp_a = [lp[t].logprob for lp, t in zip(want[0].outputs[0].logprobs, want[0].outputs[0].token_ids)]
    lp_b = [lp[t].logprob for lp, t in zip(got[0].outputs[0].logprobs, got[0].outputs[0].token_ids)]
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=0, atol=1e-5)


def test_an_abort_while_a_step_is_on_the_device(tiny_models):
    folder = tiny_models["llama"]
    ahead = _llm(folder, True)
    engine = ahead.engine
    prompts = random_prompts([6, 8], seed=23)
    for i, p in enumerate(prompts):
        engine.add(engine.input_processor.prepare(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                                  request_id=f"a{i}"))
    for _ in range(4):
        engine.step()
    assert engine.loop.busy()
    engine.abort("a0")
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert [r.request_id for r in done] == ["a1"] and len(done[0].output_token_ids) == 20
    alone = _llm(folder, False).generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                         use_tqdm=False)[0]
    assert done[0].output_token_ids == alone.outputs[0].token_ids
