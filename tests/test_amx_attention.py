"""Prefill attention with AMX tiles (``amx_attention.cpp``) where this CPU runs them, against the
plain-PyTorch definition and against the AVX512 task it stands in for; where it does not, the
same checks run on the path the CPU takes (and the AMX-only ones skip with the reason).

``TAPLLM_AMX=0`` turns the tiles off: the checks that compare both paths run the other one in a
fresh process (the choice is made once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tapllm.kernels import fused_kernels, reference

ops = fused_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler here: the kernels cannot be built")
AMX = ops is not None and bool(ops.amx_supported())
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU (or TAPLLM_AMX=0) runs no AMX tiles")


def _case(heads: int, kv_heads: int, dim: int, bs: int, chunks: list[tuple[int, int]], seed: int):
    """A paged cache with each chunk's (context, length) blocks scattered, and queries for every chunk."""
    g = torch.Generator().manual_seed(seed)
    need = [(ctx + n + bs - 1) // bs for ctx, n in chunks]
    blocks = sum(need) + 3
    k_cache = torch.randn(kv_heads, blocks, bs, dim, generator=g).bfloat16()
    v_cache = torch.randn(kv_heads, blocks, bs, dim, generator=g).bfloat16()
    order = torch.randperm(blocks, generator=g)
    tables = torch.zeros(len(chunks), max(need), dtype=torch.long)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = order[used:used + nb]
        used += nb
    lens = torch.tensor([n for _, n in chunks])
    starts = torch.cumsum(lens, 0) - lens
    q = torch.randn(int(lens.sum()), heads, dim, generator=g).bfloat16()
    return q, k_cache, v_cache, starts, lens, torch.tensor([c for c, _ in chunks]), tables


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 2, 96)])
@pytest.mark.parametrize("bs", [16, 12])
def test_prefill_attention_matches_the_definition_over_many_key_tiles(heads, kv_heads, dim, bs):
    """Chunks that start mid-tile, end past several tiles, hold one row, or follow a long context;
    windows narrower than a tile and soft-caps; block sizes that do and don't divide a tile."""
    chunks = [(0, 5), (37, 70), (130, 1), (64, 64), (500, 33), (3, 129)]
    args = _case(heads, kv_heads, dim, bs, chunks, seed=heads * dim + bs)
    for window, softcap in ((0, 0.0), (50, 0.0), (7, 0.0), (0, 30.0)):
        got = ops.prefill_attention(*args, dim**-0.5, window, softcap)
        want = reference.prefill_attention(*args, dim**-0.5, window, softcap)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [0, 70])
def test_a_row_is_the_same_in_any_chunking(window):
    """Rows prefilled whole or as a context then the rest are bitwise equal: key tiles start at the same
    positions whatever the chunk, and a row's sums come from its own scores."""
    q, k_cache, v_cache, *_ = _case(9, 3, 64, 16, [(0, 300)], seed=window)
    tables = torch.arange(k_cache.shape[1]).view(1, -1)
    one = torch.tensor

    def run(first: int, n: int) -> torch.Tensor:
        return ops.prefill_attention(q[first:first + n], k_cache, v_cache, one([0]), one([n]), one([first]),
                                     tables, 0.125, window, 0.0)

    whole = run(0, 300)
    for cut in (1, 77, 128, 200):
        assert torch.equal(torch.cat([run(0, cut), run(cut, 300 - cut)]), whole), cut


def _in_a_fresh_process(code: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_amx
def test_amx_and_avx512_tasks_agree_and_tiles_false_is_the_avx512_task(tmp_path):
    """Tiles on and off give the same probabilities (rounded to bfloat16) summed in another order: a
    bf16 rounding apart; ``tiles=False`` (batch_invariant) is the AVX512 task, bit for bit, as a process
    with ``TAPLLM_AMX=0`` runs it."""
    args = _case(9, 3, 64, 16, [(0, 200), (37, 90), (300, 17)], seed=5)
    on = ops.prefill_attention(*args, 0.125, 0, 0.0)
    off = ops.prefill_attention(*args, 0.125, 0, 0.0, False)
    torch.testing.assert_close(on.float(), off.float(), rtol=1e-2, atol=1e-2)
    torch.save(args, tmp_path / "case.pt")
    code = ("import torch\nfrom tapllm.kernels import fused_kernels\nops = fused_kernels()\n"
            "assert not ops.amx_supported()\n"
            f"args = torch.load({str(tmp_path / 'case.pt')!r})\n"
            f"torch.save(ops.prefill_attention(*args, 0.125, 0, 0.0), {str(tmp_path / 'off.pt')!r})\n")
    _in_a_fresh_process(code, TAPLLM_AMX="0")
    assert torch.equal(torch.load(tmp_path / "off.pt"), off)


def test_describe_names_the_amx_tiles_where_they_run():
    from tapllm.backends.ops import CpuAttention

    assert CpuAttention(ops).tiles == AMX
    assert not CpuAttention(ops, invariant=True).tiles


@needs_amx
def test_the_kernel_trial_runs_the_amx_task():
    """The probe's trial (``check_all``) covers the tiles: a head size of 64 over several tiles."""
    assert reference.check_all(ops) is None
