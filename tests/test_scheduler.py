"""The scheduler on its own: one token budget, chunked prefill, admission limits, preemption, cache hits."""

from __future__ import annotations

from tapllm.config import EngineConfig
from tapllm.engine.block_manager import BlockManager
from tapllm.engine.prompt_logprobs import PromptLogprobs
from tapllm.engine.request import Request, RequestStatus
from tapllm.engine.scheduler import Scheduler, SchedulerOutput
from tapllm.sampling_params import SamplingParams


def _scheduler(budget: int = 8, seqs: int = 4, blocks: int = 32, block_size: int = 4,
               prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(model="unused", max_num_batched_tokens=budget, max_num_seqs=seqs, block_size=block_size)
    return Scheduler(config, BlockManager(blocks, block_size, prefix_caching))


def _req(rid: str, num_tokens: int, first: int = 0) -> Request:
    return Request(rid, 0, None, list(range(first, first + num_tokens)), SamplingParams(), None)


def _run(sched: Scheduler, out: SchedulerOutput, sampled: int = 7) -> None:
    """What the engine does after a step: count the computed tokens, publish full blocks, append a token to
    every request whose step reached its last token."""
    for it in out.items:
        it.request.num_computed_tokens += it.num_tokens
        sched.blocks.cache_full_blocks(it.request)
        if it.samples:
            it.request.token_ids.append(sampled)


def _plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(it.request.request_id, it.start, it.num_tokens) for it in out.items]


def test_a_long_prompt_runs_in_chunks_of_the_budget():
    sched = _scheduler(budget=8)
    sched.add(_req("a", 20))
    steps, samples = [], []
    for _ in range(4):
        out = sched.schedule()
        steps.append(_plan(out))
        samples.append(out.items[0].samples)
        _run(sched, out)
    assert steps == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)], [("a", 20, 1)]]
    assert samples == [False, False, True, True]  # only a step that reaches the last token samples


def test_decodes_come_first_and_a_prompt_takes_the_rest_of_the_budget():
    sched = _scheduler(budget=8)
    for rid in ("a", "b"):
        sched.add(_req(rid, 3))
    _run(sched, sched.schedule())  # both prompts, 3 + 3 tokens
    sched.add(_req("c", 10, first=100))
    out = sched.schedule()
    assert _plan(out) == [("a", 3, 1), ("b", 3, 1), ("c", 0, 6)]
    assert [it.samples for it in out.items] == [True, True, False]


def test_max_num_seqs_keeps_requests_waiting():
    sched = _scheduler(budget=64, seqs=2)
    for rid in ("a", "b", "c"):
        sched.add(_req(rid, 2))
    out = sched.schedule()
    assert [r for r, _, _ in _plan(out)] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    sched.finish(sched.running[0])
    _run(sched, out)
    assert "c" in [r for r, _, _ in _plan(sched.schedule())]


def test_when_the_cache_runs_out_the_latest_request_is_preempted_and_recomputed_first():
    sched = _scheduler(budget=64, blocks=4, block_size=2, prefix_caching=False)
    a, b = _req("a", 3), _req("b", 3, first=10)
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule())  # 2 blocks each: the cache is full
    _run(sched, sched.schedule())  # 4 tokens each: still 2 blocks each
    out = sched.schedule()  # the 5th token needs a third block: b gives its blocks to a
    assert _plan(out) == [("a", 4, 1)]
    assert out.preempted == [b]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.block_table == [] and sched.waiting[0] is b
    sched.finish(a)
    assert _plan(sched.schedule()) == [("b", 0, 5)]  # its tokens so far, recomputed at once


def test_a_cached_prefix_is_skipped_unless_the_request_must_compute_it():
    sched = _scheduler(budget=64, block_size=4)
    first = _req("a", 10)
    sched.add(first)
    _run(sched, sched.schedule())
    sched.finish(first)
    again = _req("b", 10)
    sched.add(again)
    assert _plan(sched.schedule()) == [("b", 8, 2)]  # two full blocks from the cache
    assert again.num_cached_tokens == 8
    scored = _req("c", 10)
    scored.prompt_lp = PromptLogprobs(scored.prompt_token_ids, 1)  # needs every prompt position run
    sched.add(scored)
    assert _plan(sched.schedule())[-1] == ("c", 0, 10)


def test_a_request_larger_than_the_whole_cache_is_dropped():
    sched = _scheduler(budget=64, blocks=2, block_size=2)
    big = _req("big", 9)
    sched.add(big)
    out = sched.schedule()
    assert out.dropped == [big] and out.items == [] and not sched.has_unfinished()


def test_finish_frees_the_blocks_and_forgets_the_request():
    sched = _scheduler(budget=64, blocks=8, block_size=2, prefix_caching=False)
    req = _req("a", 5)
    sched.add(req)
    _run(sched, sched.schedule())
    assert sched.blocks.num_free_blocks == 5
    sched.finish(req)
    assert sched.blocks.num_free_blocks == 8 and not sched.has_unfinished()
