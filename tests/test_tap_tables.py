"""The slot tables of a graph step's tap, and the Triton site kernel against its PyTorch reference.

The kernel runs in Triton's interpreter here (conftest turns it on without a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tapllm.kernels import reference, triton_tap
from tapllm.tap.sites import Sites
from tapllm.tap.tables import NO_END, OP_ADD, OP_DIRECTION, OP_SCALE, OP_SET, RangeAllocator, SlotCapture, SlotOp, \
    TapTables

pytestmark = pytest.mark.skipif(not triton_tap.available(torch.device("cpu")),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

HIDDEN, HEADS, HEAD_DIM, D_MLP, LAYERS = 24, 4, 6, 40, 3
SHAPES = {"embed": (HIDDEN,), "resid_pre": (HIDDEN,), "attn_out": (HIDDEN,), "resid_mid": (HIDDEN,),
          "mlp_out": (HIDDEN,), "resid_post": (HIDDEN,), "final": (HIDDEN,), "q": (HEADS, HEAD_DIM),
          "k": (2, HEAD_DIM), "v": (2, HEAD_DIM), "z": (HEADS, HEAD_DIM), "mlp_post": (D_MLP,)}


def _tables(dtype: torch.dtype, slots: int = 6, rows: int = 12) -> TapTables:
    return TapTables(Sites(LAYERS, SHAPES), slots, rows, torch.device("cpu"), dtype, max_ops=64, pool_rows=64,
                     capture_numbers=4096)


def test_sites_number_every_point_once():
    sites = Sites(LAYERS, SHAPES)
    assert len(sites) == 2 + 10 * LAYERS
    assert sites.of("embed", -1).index == 0 and sites.of("final", -1).width == HIDDEN
    q = sites.of("q", 1)
    assert (q.groups, q.group_width, q.width) == (HEADS, HEAD_DIM, HEADS * HEAD_DIM)
    assert sites.of("mlp_post", 2).groups == 1 and sites.max_width == D_MLP
    assert sorted(s.index for s in sites.all) == list(range(len(sites)))


def test_range_allocator_first_fit_and_merge():
    a = RangeAllocator(10)
    assert a.take(4) == 0 and a.take(3) == 4 and a.take(4) is None
    a.give(0, 4)
    assert a.take(2) == 0 and a.take(2) == 2
    a.give(0, 2), a.give(2, 2), a.give(4, 3)
    assert a.used == 0 and a.take(10) == 0


def _random_ops(g: torch.Generator, sites: Sites, dtype: torch.dtype) -> list[SlotOp]:
    ops = []
    for site in sites.all:
        if site.point in ("embed", "final") or torch.rand(1, generator=g) < 0.6:
            continue
        for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
            kind = int(torch.randint(1, 5, (1,), generator=g))
            lo = int(torch.randint(0, 4, (1,), generator=g))
            hi = NO_END if torch.rand(1, generator=g) < 0.5 else lo + int(torch.randint(1, 6, (1,), generator=g))
            stride = 1 if kind == OP_SET and hi != NO_END else 0
            n = hi - lo if stride else 1
            w = site.width
            if kind == OP_ADD:
                rows = torch.randn(n, w, generator=g).to(dtype).float()
            elif kind == OP_SCALE:
                rows = torch.where(torch.rand(n, w, generator=g) < 0.3, 1.0, torch.randn(n, w, generator=g))
            elif kind == OP_DIRECTION:
                u = torch.randn(n, site.groups, site.group_width, generator=g)
                rows = (u / u.norm(dim=-1, keepdim=True)).reshape(n, w)
            else:
                rows = torch.randn(n, w, generator=g).to(dtype).float()
                rows[torch.rand(n, w, generator=g) < 0.4] = float("nan")
            ops.append(SlotOp(site.index, kind, lo, hi, rows, stride, float(torch.randn(1, generator=g))))
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_site_kernel_equals_reference(dtype):
    g = torch.Generator().manual_seed(0)
    kern, ref = _tables(dtype), _tables(dtype)
    sites = kern.sites
    for t in (kern, ref):  # slots 1, 2, 3 tap; 0 and 4 do nothing; 5 is padding
        g.manual_seed(1)
        for slot in (1, 2, 3):
            chosen = [s.index for s in sites.all if torch.rand(1, generator=g) < 0.4]
            offsets, rec = {}, 0
            for s in chosen:
                offsets[s] = rec
                rec += sites.all[s].width
            cap = SlotCapture(offsets, rec, int(torch.randint(0, 3, (1,), generator=g)), 7, last_only=slot == 3)
            assert t.write(slot, cap if slot != 2 else None, _random_ops(g, sites, dtype)) is None
        t.flush_pending()
    row_slot = torch.tensor([1, 1, 1, 0, 2, 2, 3, 3, 3, 4, 5, 5])
    positions = torch.tensor([2, 3, 4, 9, 0, 1, 4, 5, 6, 3, 0, 0])
    last = torch.tensor([0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    base_host, total = kern.places(row_slot.numpy(), positions.numpy(), last.numpy())
    for t in (kern, ref):
        t.prologue(row_slot, positions, last)
        assert t.row_base.tolist() == base_host.tolist()
    assert total > 0 and base_host[8] >= 0 and base_host[6] == -1  # positions="last": the chunk's last row only
    for site in sites.all:
        x = torch.randn(12, site.width, generator=g).to(dtype)
        if site.groups > 1:
            x = x.view(12, site.groups, site.group_width)
        y = x.clone()
        triton_tap.tap_site(x, site, kern, row_slot, positions)
        reference.tap_site(y, site, ref, row_slot, positions)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    torch.testing.assert_close(kern.cap_out[:total], ref.cap_out[:total], rtol=1e-2, atol=1e-2)


def test_untapped_rows_are_left_exactly_as_they_were():
    t = _tables(torch.bfloat16)
    site = t.sites.of("resid_post", 1)
    ops = [SlotOp(site.index, OP_SCALE, 0, NO_END, torch.full((1, HIDDEN), 3.0)),
           SlotOp(site.index, OP_DIRECTION, 0, NO_END, torch.nn.functional.normalize(torch.randn(1, HIDDEN)), value=2.0)]
    assert t.write(2, None, ops) is None
    t.flush_pending()
    row_slot, positions = torch.tensor([0, 2, 1]), torch.tensor([5, 5, 5])
    t.prologue(row_slot, positions, torch.ones(3, dtype=torch.bool))
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    before = x.clone()
    triton_tap.tap_site(x, site, t, row_slot, positions)
    assert torch.equal(x[0], before[0]) and torch.equal(x[2], before[2]) and not torch.equal(x[1], before[1])


def _taps(t: TapTables, slot: int) -> bool:
    """Whether ``slot`` captures or steers anything, by the tables' own record."""
    return bool(t.rec[slot].any()) or bool(t.steered[slot])


def test_a_cleared_slot_frees_its_operands_and_captures_nothing():
    t = _tables(torch.float32)
    site = t.sites.of("resid_pre", 0)
    big = SlotOp(site.index, OP_ADD, 0, NO_END, torch.ones(40, HIDDEN), stride=1)
    assert t.write(1, SlotCapture({site.index: 0}, HIDDEN, 0, 100), [big]) is None
    assert "exceed" in t.write(2, None, [SlotOp(site.index, OP_ADD, 0, NO_END, torch.ones(30, HIDDEN), 1)])
    assert not _taps(t, 2)
    t.clear(1)
    assert not _taps(t, 1) and t.write(2, None, [SlotOp(site.index, OP_ADD, 0, NO_END, torch.ones(30, HIDDEN), 1)]) is None
    base, total = t.places(np.array([1, 2]), np.array([0, 0]), np.array([True, True]))
    assert total == 0 and base.tolist() == [-1, -1]
    assert "capture buffer" in t.write(3, SlotCapture({site.index: 0}, 10**6, 0, 1), [])


@pytest.mark.parametrize("seed", range(6))
def test_places_by_chunk_equal_places_by_row(seed):
    """A step's chunks (decodes and prompt chunks, some slots capturing the last position only, some
    cleared) are placed by chunk exactly as the prologue's per-row rule places their rows."""
    g = torch.Generator().manual_seed(seed)
    t = TapTables(Sites(LAYERS, SHAPES), 8, 64, torch.device("cpu"), torch.float32, max_ops=1, pool_rows=1,
                  capture_numbers=1 << 20)
    for slot in range(7):
        lo, span = int(torch.randint(0, 20, (1,), generator=g)), int(torch.randint(0, 30, (1,), generator=g))
        last = bool(torch.rand(1, generator=g) < 0.3)
        assert t.write(slot, SlotCapture({0: 0}, 3 + slot, lo, lo + span if span else NO_END, last), []) is None
    t.clear(int(torch.randint(0, 7, (1,), generator=g)))
    slots = torch.randperm(8, generator=g)[: int(torch.randint(1, 8, (1,), generator=g))].tolist()
    starts = torch.randint(0, 40, (len(slots),), generator=g).tolist()
    sizes = [1 if torch.rand(1, generator=g) < 0.5 else int(torch.randint(1, 12, (1,), generator=g)) for _ in slots]
    row_slot = np.repeat(slots, sizes)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes)])
    last_rows = np.concatenate([np.arange(n) == n - 1 for n in sizes])
    base, total = t.places(row_slot, positions, last_rows)
    chunks, chunk_total = t.chunk_places(slots, starts, sizes)
    assert chunk_total == total
    expect = []
    first_row = np.cumsum([0, *sizes[:-1]])
    for i, (r, n) in enumerate(zip(first_row, sizes)):
        placed = [int(p) for p in base[r : r + n] if p >= 0]
        if placed:
            rec = int(t.rec[slots[i]])
            assert placed == [placed[0] + k * rec for k in range(len(placed))]  # consecutive records
            expect.append((i, placed[0], len(placed)))
    assert chunks == expect
    if all(n == 1 for n in sizes):
        assert t.chunk_places(slots, starts) == (chunks, total)
