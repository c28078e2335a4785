"""The graph-safe sampler gives exactly the eager plan's tokens; the counter-based RNG is the same
on host and device; seeded requests are reproducible whatever shares their batch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import random_prompts
from test_device_step import CopyWatch, StepWatch
from tapllm import LLM, SamplingParams
from tapllm.engine.graph_sampler import SlotSampling
from tapllm.engine.request import Request
from tapllm.engine.rng import as_int64, uniform_device, uniform_host
from tapllm.engine.sampler import SamplingPlan
from tapllm.engine.staging import Download, Staging

CPU = torch.device("cpu")


# ---- the RNG ---------------------------------------------------------------------------------
def test_rng_host_and_device_agree_bit_for_bit():
    g = np.random.default_rng(0)
    seeds = np.concatenate([g.integers(-2**63, 2**63 - 1, 50_000, dtype=np.int64, endpoint=True),
                            np.array([0, 1, -1, 2**63 - 1, -2**63], dtype=np.int64)])
    counters = np.concatenate([g.integers(0, 2**62, 50_000, dtype=np.int64), np.array([0, 1, 2, 2**62, 7])])
    host = uniform_host(seeds, counters)
    device = uniform_device(torch.from_numpy(seeds), torch.from_numpy(counters))
    assert device.dtype == torch.float64
    assert np.array_equal(host, device.numpy())
    assert ((host >= 0) & (host < 1)).all()


def test_rng_is_uniform_and_streams_are_distinct():
    seeds, counters = np.meshgrid(np.arange(400), np.arange(400))  # nearby seeds and counters
    u = uniform_host(seeds.ravel(), counters.ravel())
    bins = np.bincount((u * 200).astype(np.int64), minlength=200)
    expected = u.size / 200
    chi2 = ((bins - expected) ** 2 / expected).sum()
    assert chi2 < 290, chi2  # 199 degrees of freedom: p < 1e-4 above 290
    assert len(np.unique(u)) == u.size  # no two (seed, counter) pairs share a draw
    bits = (u * 2.0**53).astype(np.int64)
    ones = [((bits >> b) & 1).mean() for b in range(53)]  # every one of the 53 bits is random
    assert max(abs(p - 0.5) for p in ones) < 0.01, ones
    # neighbouring streams are uncorrelated
    a, b = uniform_host(np.full(20_000, 5), np.arange(20_000)), uniform_host(np.full(20_000, 6), np.arange(20_000))
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.03
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.03


def test_seeds_are_read_as_their_low_64_bits():
    assert as_int64(2**64 - 1) == -1 and as_int64(2**63) == -2**63 and as_int64(-5) == -5
    with pytest.raises(ValueError, match="seed must be an integer in"):
        as_int64(2**64)
    with pytest.raises(ValueError, match="one shape"):
        uniform_host(np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64))


# ---- the slot sampler against the plan -------------------------------------------------------
def _random_params(g: np.random.Generator, vocab: int) -> SamplingParams:
    greedy = g.random() < 0.25
    return SamplingParams(
        temperature=0.0 if greedy else float(g.choice([1e-6, 0.3, 0.7, 1.0, 1.6])),
        top_k=int(g.choice([0, -1, 1, 2, 5, 40, vocab, vocab + 3])),
        top_p=float(g.choice([1.0, 1.0, 0.999, 0.9, 0.5, 0.2, 1e-3, 1 - 1e-9])),
        min_p=float(g.choice([0.0, 0.0, 0.02, 0.3])))


def _random_logits(g: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.randint(0, 4, (rows, 1), generator=g)]
    x = torch.randn(rows, vocab, generator=g) * scale
    levels = torch.randint(0, 3, (rows,), generator=g)
    x[levels == 1] = (x[levels == 1] * 2).round() / 2  # coarse: many exact ties, at every cut
    head = torch.randint(2, 9, (1,), generator=g).item()  # a tied block of most likely tokens
    x[levels == 2, :head] = x[levels == 2].amax(dim=-1, keepdim=True) + 0.5
    x = x.to(dtype)
    bad = torch.rand(rows, generator=g)
    x[bad < 0.06, 3] = float("nan")
    x[(bad >= 0.06) & (bad < 0.1), 0] = float("-inf")
    x[(bad >= 0.1) & (bad < 0.12), 1] = float("inf")
    return x


def _plan_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 counters: list[int]) -> torch.Tensor:
    staging = Staging(logits.device)
    staging.begin()
    requests = [Request(f"r{i}", 0, None, [7] * c, p, None if p.greedy else s)
                for i, (p, s, c) in enumerate(zip(params, seeds, counters))]
    plan = SamplingPlan(requests, logits.shape[-1], staging, logits.device)
    plan.bind(staging.upload())
    return plan.sample(logits, None, None)


def _slots(params: list[SamplingParams], seeds: list[int], vocab: int, device: torch.device,
           g: np.random.Generator) -> tuple[SlotSampling, torch.Tensor]:
    """A slot table holding ``params`` (in slots picked at random, with free slots between) and their slots."""
    n = len(params)
    sampling = SlotSampling(n + 3, vocab, device)
    slots = g.permutation(n + 3)[:n]
    for slot, p, s in zip(slots, params, seeds):
        sampling.write(int(slot), p, s)
    return sampling, torch.from_numpy(slots).long().to(device)


def _slot_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], counters: list[int],
                 g: np.random.Generator) -> torch.Tensor:
    sampling, slots = _slots(params, seeds, logits.shape[-1], logits.device, g)
    draw = not all(p.greedy for p in params)
    return sampling.sample(logits, slots, torch.tensor(counters, device=logits.device), draw)


def _random_case(g: np.random.Generator, tg: torch.Generator, vocab: int, dtype: torch.dtype, rows: int):
    logits = _random_logits(tg, rows, vocab, dtype)
    params = [_random_params(g, vocab) for _ in range(rows)]
    seeds = [int(s) for s in g.integers(-2**63, 2**63 - 1, rows, endpoint=True)]
    counters = [int(c) for c in g.integers(1, 5000, rows)]
    return logits, params, seeds, counters


class _Searches:
    """Records what each inverse-CDF pick searched: the cdf rows and their scaled uniforms."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        search = torch.searchsorted

        def recorded(cdf, u, **kwargs):
            self.calls.append((cdf, u))
            return search(cdf, u, **kwargs)

        monkeypatch.setattr(torch, "searchsorted", recorded)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        call = self.calls[-1] if self.calls else None
        self.calls.clear()
        return call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 1000])
def test_slot_sampler_gives_the_plans_tokens(dtype, vocab, monkeypatch):
    """Random logits (ties, non-finite rows) and random parameter mixes: token for token the plan's,
    from bit-identical distributions and uniforms (so no difference hides below the draws' reach)."""
    g, tg = np.random.default_rng(vocab), torch.Generator().manual_seed(vocab)
    searches = _Searches(monkeypatch)
    for trial in range(40):
        logits, params, seeds, counters = _random_case(g, tg, vocab, dtype, int(g.integers(1, 12)))
        expected = _plan_tokens(logits, params, seeds, counters)
        planned = searches.take()
        got = _slot_tokens(logits, params, seeds, counters, g)
        drawn = searches.take()
        assert got.dtype == torch.float64
        assert torch.equal(got, expected), (trial, got, expected, params)
        finite = torch.isfinite(logits.float()).all(dim=-1)
        assert torch.equal(got < 0, ~finite)
        draws = [j for j, p in enumerate(params) if not p.greedy]
        assert (planned is None) == (drawn is None) == (not draws)
        for i, j in enumerate(draws):
            if finite[j]:
                assert torch.equal(planned[0][i], drawn[0][j]) and torch.equal(planned[1][i], drawn[1][j]), (trial, j)


def test_ties_at_every_cut_are_kept_whatever_the_batch():
    """Tokens tied with the last one top-k or top-p keeps stay with it, so a row's token is the same
    alone and in any batch (the CPU plan orders only the top 256 when they hold every row's top-p)."""
    vocab = 600
    row = torch.full((vocab,), -4.0)
    row[[5, 70, 300, 599]] = 2.0  # four tied tokens; top_p 0.3 cuts inside them, top_k 2 too
    flat = torch.zeros(vocab)  # its top-p needs the whole row sorted
    batch = torch.stack([row, flat, row])
    cuts = [SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=1.0, top_k=2)]
    for p in cuts:
        alone = [_plan_tokens(row[None], [p], [s], [3]).item() for s in range(64)]
        assert {int(t) for t in alone} == {5, 70, 300, 599}
        for s in range(64):
            params = [p, SamplingParams(temperature=1.0, top_p=0.9), p]
            mixed = _plan_tokens(batch, params, [s, 1, s], [3, 3, 3])
            assert mixed[0].item() == mixed[2].item() == alone[s]
            assert torch.equal(_slot_tokens(batch, params, [s, 1, s], [3, 3, 3], np.random.default_rng(s)), mixed)


def test_greedy_step_and_failures():
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    logits[2, 7] = float("nan")
    sampling = SlotSampling(4, vocab, CPU)  # never written: every slot greedy
    out = sampling.sample(logits, torch.arange(4), torch.ones(4, dtype=torch.int64), draw=False)
    expected = logits.argmax(dim=-1).double()
    expected[2] = -1
    assert torch.equal(out, expected)
    assert torch.equal(sampling.sample(logits, torch.arange(4), torch.ones(4, dtype=torch.int64), draw=True), out)
    with pytest.raises(ValueError, match="slot must be in"):
        sampling.write(4, SamplingParams(), 1)
    with pytest.raises(ValueError, match="seed is required"):
        sampling.write(0, SamplingParams(temperature=1.0), None)
    with pytest.raises(ValueError, match="seed must be an integer in"):
        sampling.write(0, SamplingParams(temperature=1.0), 2**64)


def test_slot_sampling_reads_nothing_on_the_host():
    vocab = 300
    g = np.random.default_rng(4)
    sampling = SlotSampling(8, vocab, CPU)
    for slot in range(8):
        sampling.write(slot, _random_params(g, vocab), slot * 11)
    logits = _random_logits(torch.Generator().manual_seed(4), 6, vocab, torch.bfloat16)
    slots, counters = torch.tensor([3, 0, 7, 1, 5, 2]), torch.arange(10, 16)
    owner = SimpleNamespace(staging=Staging(CPU), download=Download(CPU))
    functions, copies = StepWatch(owner), CopyWatch(owner)
    with functions, copies:
        sampling.sample(logits, slots, counters, draw=True)
        sampling.sample(logits, slots, counters, draw=False)
    assert functions.host == [] and copies.syncs == []


@pytest.mark.cuda
def test_on_cuda_the_plans_tokens_and_a_graph_replays_them():
    """On the GPU: host and device uniforms agree, the slot sampler gives the plan's tokens (the plan
    sorts only its nucleus rows there), and a CUDA graph of it replays them with new inputs and slots."""
    cuda = torch.device("cuda")
    seeds, counters = np.arange(-5000, 5000, dtype=np.int64) * 7919, np.arange(10_000, dtype=np.int64) * 31
    assert np.array_equal(uniform_host(seeds, counters),
                          uniform_device(torch.from_numpy(seeds).to(cuda), torch.from_numpy(counters).to(cuda)).cpu().numpy())
    g, tg = np.random.default_rng(5), torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (37, 1000, 151_936):
            for _ in range(4 if vocab > 1000 else 15):
                logits, params, seeds, counters = _random_case(g, tg, vocab, dtype, int(g.integers(1, 40)))
                logits = logits.to(cuda)
                assert torch.equal(_slot_tokens(logits, params, seeds, counters, g),
                                   _plan_tokens(logits, params, seeds, counters))
    rows, vocab = 16, 32_000
    logits, params, seeds, counters = _random_case(g, tg, vocab, torch.bfloat16, rows)
    sampling, slots = _slots(params, seeds, vocab, cuda, g)
    inputs = (logits.to(cuda), slots, torch.tensor(counters, device=cuda))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as CUDA graphs require
        sampling.sample(*inputs, draw=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling.sample(*inputs, draw=True)
    for trial in range(6):
        logits, params, seeds, counters = _random_case(g, tg, vocab, torch.bfloat16, rows)
        for slot, p, s in zip(slots.tolist(), params, seeds):  # new requests join the same slots
            sampling.write(slot, p, s)
        order = g.permutation(rows)
        inputs[0].copy_(logits[order])
        inputs[1].copy_(slots[order])
        inputs[2].copy_(torch.tensor(counters)[order])
        graph.replay()
        expected = _plan_tokens(logits.to(cuda)[order], [params[i] for i in order], [seeds[i] for i in order],
                                [counters[i] for i in order])
        assert torch.equal(out, expected), trial


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_any_batch(llm):
    target = random_prompts([10], seed=21)[0]
    params = SamplingParams(max_tokens=12, temperature=1.1, top_p=0.9, min_p=0.02, seed=2**64 - 3, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts([4, 17, 9], seed=22)
    mix = [SamplingParams(max_tokens=5, temperature=0.8, seed=9, ignore_eos=True),
           SamplingParams(max_tokens=20, temperature=1.0, top_k=30, ignore_eos=True),  # unseeded
           SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    outs = llm.generate([others[0], target, *others[1:]], [mix[0], params, *mix[1:]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    outs = llm.generate([*others, target], [*mix, params], use_tqdm=False)
    assert outs[3].outputs[0].token_ids == alone


def test_samples_of_one_seeded_request_are_reproducible(llm):
    prompt = random_prompts([8], seed=23)[0]
    params = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=123, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    other = random_prompts([13], seed=24)
    busy = llm.generate([other[0], prompt], [SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True), params],
                        use_tqdm=False)[1]
    assert [o.token_ids for o in busy.outputs] == first
    assert len({tuple(t) for t in first}) == 3  # each sample draws from its own seed
