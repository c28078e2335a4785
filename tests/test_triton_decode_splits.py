"""Decode attention shares each row's own keys among its programs, whatever the table's width.

The grid is static (rows x KV heads x :func:`ta.decode_splits`, from shapes); each row splits
the keys it sees evenly over the splits it needs (:func:`ta.row_splits`). The tests catch the
split kernel's partial buffers (filled with NaN first, so an unwritten split shows) to see
which splits each row wrote, and compare the output with the eager path. The interpreter's
set-up and the NaN-poisoned cache are ``triton_paged``'s.
"""

from __future__ import annotations

import pytest
import torch
from triton_paged import (  # first: it decides Triton's mode before triton is imported
    TOL,
    Paged,
    cuda,
    interpret,  # noqa: F401 - a fixture
    options,
)

from tapllm.kernels import triton_attention as ta
from tapllm.layers.attention import AttentionMetadata, _decode_attention


@pytest.fixture
def partials(monkeypatch):
    """The split kernel's partial buffers, NaN-filled, as the next decode allocates them."""
    caught: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    allocate = ta._partials

    def nan_partials(batch, heads, splits, dim, device):
        bufs = tuple(t.fill_(float("nan")) for t in allocate(batch, heads, splits, dim, device))
        caught.append(bufs)
        return bufs

    monkeypatch.setattr(ta, "_partials", nan_partials)
    return caught


def _reference(q: torch.Tensor, paged: Paged, tables: torch.Tensor, lens: torch.Tensor, window: int,
               softcap: float) -> torch.Tensor:
    """The eager decode path over the whole table width, in float32."""
    keys = torch.arange(tables.shape[1] * paged.page, device=q.device)
    lens = lens.long()
    meta = AttentionMetadata(slot_mapping=lens.new_zeros(0), num_decodes=q.shape[0], decode_block_tables=tables.long(),
                             decode_mask=(keys[None, :] >= lens[:, None])[:, None, :], prefills=[], decode_lens=lens)
    return _decode_attention(q.float(), paged.k32, paged.v32, meta, options(q.shape[2], window, softcap))


def _check(q: torch.Tensor, paged: Paged, lens: list[int], window: int, softcap: float, dtype: torch.dtype,
           caught: list) -> int:
    """Decode, compare with the eager path, and check each row wrote exactly the splits it needs; the split count."""
    lens_t = torch.tensor(lens, dtype=torch.int32, device=q.device)
    got = ta.decode_attention(q, paged.k, paged.v, paged.tables, lens_t, q.shape[2] ** -0.5, window, softcap)
    live = lens_t > 0
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    want = _reference(q[live], paged, paged.tables[live], lens_t[live], window, softcap)
    torch.testing.assert_close(got[live].float(), want, rtol=TOL[dtype], atol=TOL[dtype])
    splits = ta.decode_splits(len(lens), paged.k.shape[0], paged.tables.shape[1] * paged.page)
    _, _, part_l = caught.pop()
    assert part_l.shape[2] == splits
    for b, n in enumerate(lens):
        need = ta.row_splits(n, splits, window)
        written = part_l[b].isfinite()  # [H, splits]
        if need == 1:  # stored directly by its one program
            assert not written.any(), f"row {b} ({n} keys): one split, yet partials written"
        else:
            assert written[:, :need].all() and not written[:, need:].any(), f"row {b} ({n} keys): wants {need}"
            if ta.row_splits(n, 10**9, window) <= splits:  # not capped: every split got a share of the keys
                assert (part_l[b, :, :need] >= 1.0).all(), f"row {b}: a split saw no key"
    return splits


def test_decode_long_row_in_a_wide_table_uses_every_split(interpret, partials):
    """Batch 1, 8k keys in a table 128k keys wide: each of the row's 64 programs gets 128 keys (split
    by the table's width, all of them would have landed in the first four)."""
    g = torch.Generator().manual_seed(37)
    n, page, width = 8192, 16, 8192
    paged = Paged(g, [n], 1, 64, page, torch.float32, spare=width - n // page)
    assert paged.tables.shape[1] * page == 131072
    q = torch.randn(1, 2, 64, generator=g)
    assert _check(q, paged, [n], 0, 0.0, torch.float32, partials) == 64
    assert ta.row_splits(n, 64) == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_use_the_splits_their_length_needs(interpret, partials, dtype):
    """Rows of many lengths (0, within one tile, at the two-tile edge, long) in one wide batch, with
    and without a window (which counts only the keys it keeps) and a soft-cap."""
    g = torch.Generator().manual_seed(41)
    lens = [0, 1, 100, 128, 129, 700, 1500, 3]
    paged = Paged(g, lens, 1, 64, 16, dtype, spare=1000, scale=2.0)
    q = torch.randn(len(lens), 4, 64, generator=g).to(dtype)
    scores = ((0, 0.0), (300, 0.0), (1, 0.0), (0, 5.0)) if dtype == torch.float32 else ((0, 0.0), (300, 5.0))
    for window, softcap in scores:
        assert _check(q, paged, lens, window, softcap, dtype, partials) == 64


def test_row_splits():
    assert [ta.row_splits(n, 8) for n in (0, 1, 128, 129, 256, 257, 1024, 10**6)] == [1, 1, 1, 2, 2, 3, 8, 8]
    assert ta.row_splits(1500, 64, window=300) == 3  # keys 1152.. (the tile of key 1200 on): 348 of them
    assert ta.row_splits(1500, 64, window=2000) == 12


# ---- on the GPU, compiled, at real sizes ----------------------------------------------------------


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_decode_long_rows_in_a_wide_table(partials, dtype):
    """Llama-3-8B's heads; a batch of one 8k row, and a batch of mixed lengths, in tables 128k keys wide."""
    g = torch.Generator().manual_seed(43)
    for lens in ([8192], [8192, 1, 0, 300, 20000, 4095]):
        need = max(-(-n // 16) for n in lens)
        paged = Paged(g, lens, 8, 128, 16, dtype, spare=8192 - need, scale=2.0).to("cuda")
        q = torch.randn(len(lens), 32, 128, generator=g).to(dtype).cuda()
        for window, softcap in ((0, 0.0), (4096, 0.0), (0, 30.0)):
            _check(q, paged, lens, window, softcap, dtype, partials)
