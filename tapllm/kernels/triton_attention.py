"""Attention over tapllm's paged KV cache in Triton: the CUDA backend's decode, prefill, unified step and KV write.

Decode, prefill and the KV write mirror the fused CPU kernels' signatures
(``meta.kernels.decode_attention``, ``prefill_attention`` and ``kv_write`` in
:mod:`tapllm.layers.attention`), so a backend can swap them in; plain PyTorch
(:func:`tapllm.layers.attention.paged_attention` without kernels) stays their definition.
Triton is imported only when an op runs or :func:`available` is asked. The kernels are
compiled for CUDA tensors; with ``TRITON_INTERPRET=1`` set before triton is imported,
Triton's interpreter runs them instead, on CPU tensors too (the tests).

- :func:`decode_attention` reads each sequence's keys from its blocks in place, splits long
  contexts over several programs (flash-decoding: the number of programs per row chosen from
  shapes only, each row sharing its own keys among as many of them as it needs) and merges
  them in a second kernel. Nothing in it reads a value on the host and its launches depend on
  shapes only, so a CUDA graph captured once replays with new lengths and tables; rows of
  length 0 (a graph bucket's padding) read nothing and give zeros.
- :func:`prefill_attention` attends every prefill chunk of a step in one launch: fresh prompts
  and chunks that continue a cached context alike, since every chunk's keys (its own
  included, already written) are read from the cache.
- :func:`unified_attention` attends a whole ragged step, chunks and decodes alike, in one
  launch whose grid depends only on the step's token bucket and maximum number of sequences
  (graph-safe): the rows' split among sequences, their contexts and their rows of the
  engine's block table are read from device tensors.
- :func:`decode_rows` is :func:`decode_attention` for ``batch_invariant``: each decode row a
  one-token chunk of the prefill kernel, whose rows (with ``invariant``) get the same arithmetic in
  any chunk, tile or step: every tile masked, key tiles at multiples of the tile size, no split.
- :func:`kv_write` stores new keys and values at flat slots (a negative slot is skipped),
  zeroing values that are not finite, as the eager path does.

Head sizes up to 256 (others are padded to a power of two and masked), any number of query
heads per KV head, float16/bfloat16/float32; index tensors may be int32 or int64.
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.kernels.triton_modules import kernels_module, runs_on

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256

# Decode: keys per tile, and how the split count is chosen (from shapes only). Splits are added
# until about _TARGET_PROGRAMS programs run (a few per SM on current GPUs), each with at least
# _MIN_SPLIT_TILES tiles of keys, and never more than _MAX_SPLITS.
_DECODE_BLOCK_N = 64
_TARGET_PROGRAMS = 512
_MIN_SPLIT_TILES = 2
_MAX_SPLITS = 64


def _kernels() -> Any | None:
    """The kernels' module (importing triton), or None when triton cannot be imported."""
    return kernels_module("triton_attention_kernels")


def available(device: torch.device | str | torch.Tensor) -> bool:
    """Whether the kernels can run on ``device`` (or a tensor's device): triton is importable and
    the device is CUDA, or it is the CPU and Triton's interpreter is on (``TRITON_INTERPRET=1``,
    which must be set before triton is first imported: Triton reads it when it defines its kernels)."""
    return runs_on(_kernels(), device)


def _launcher(op: str, t: torch.Tensor) -> tuple[Any, bool]:
    """The kernels' module for ``op`` on tensors like ``t``, and whether they run in the interpreter."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError(f"{op}: triton cannot be imported (pip install triton)")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and kernels.INTERPRETED):
        raise ValueError(f"{op}: tensors must be on a CUDA device, or on the CPU with Triton's interpreter on "
                         f"(TRITON_INTERPRET=1 before triton is imported); got {t.device}")
    return kernels, kernels.INTERPRETED


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _check_cache(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q [rows, H, D] against the head-major caches; returns (H, Hkv, page, D)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k_cache and v_cache must both be [num_kv_heads, num_blocks, block_size, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    kv_heads, _, page, dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != dim:
        raise ValueError(f"{op}: q must be [rows, heads, {dim}] (the cache's head_dim); got {tuple(q.shape)}")
    heads = q.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{op}: q's heads ({heads}) must be a multiple of the cache's KV heads ({kv_heads})")
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {dim} is over the limit of {MAX_HEAD_DIM}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{op}: q, k_cache and v_cache must share one dtype of float16/bfloat16/float32; "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{op}: k_cache and v_cache rows (head_dim) must be contiguous")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
    return heads, kv_heads, page, dim


def _check_index(op: str, name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    if t.dim() != dims or t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{op}: {name} must be a {dims}-D int32 or int64 tensor; got {t.dim()}-D {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, q on {device}")


def _score_args(op: str, scale: float, window: int | None,
                softcap: float | None) -> tuple[float, float, int, bool, bool]:
    """(qk_mul, cap_mul, window, SOFTCAP, WINDOW) as the kernels take them (see the kernels' module)."""
    window, softcap = int(window or 0), float(softcap or 0.0)
    if window < 0:
        raise ValueError(f"{op}: window must be >= 0 (0: none); got {window}")
    if softcap < 0:
        raise ValueError(f"{op}: softcap must be >= 0 (0: none); got {softcap}")
    if softcap > 0:
        return scale / softcap, softcap * _LOG2E, window, True, window > 0
    return scale * _LOG2E, 1.0, window, False, window > 0


def _precision(dtype: torch.dtype) -> str:
    # float32 scores must not go through TF32 tensor cores (10-bit mantissa); halves ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_config(dtype: torch.dtype, block_d: int, group: int) -> tuple[int, int, int, int]:
    """Prefill tiles: (rows per query tile, keys per tile, warps, pipeline stages); rows are
    (token, head) pairs, at least one token's worth of the group's heads."""
    block_m, block_n = 64, (64 if block_d <= 128 else 32)
    stages = 2 if dtype == torch.float32 or block_d > 128 else 3
    return max(block_m, _pow2(group)), block_n, (4 if block_d <= 128 else 8), stages


def decode_splits(batch: int, kv_heads: int, max_keys: int) -> int:
    """How many programs share one (sequence, KV head)'s keys: from shapes only (graph-safe)."""
    tiles = _cdiv(max_keys, _DECODE_BLOCK_N)
    for_occupancy = _cdiv(_TARGET_PROGRAMS, max(1, batch * kv_heads))
    return max(1, min(for_occupancy, _cdiv(tiles, _MIN_SPLIT_TILES), _MAX_SPLITS))


def row_splits(length: int, splits: int, window: int = 0) -> int:
    """How many of its ``splits`` programs a decode row of ``length`` keys uses (as the kernels
    plan it): one per ``_MIN_SPLIT_TILES`` tiles of its visible keys, at least one."""
    first = max(length - window, 0) if window > 0 else 0
    span = length - first // _DECODE_BLOCK_N * _DECODE_BLOCK_N
    return max(1, min(splits, _cdiv(span, _MIN_SPLIT_TILES * _DECODE_BLOCK_N)))


def _partials(batch: int, heads: int, splits: int, dim: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split kernel's partial buffers (sum, max, denominator); only the splits a row uses are written."""
    return (torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=device),
            torch.empty(batch, heads, splits, dtype=torch.float32, device=device),
            torch.empty(batch, heads, splits, dtype=torch.float32, device=device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int | None = 0,
                     softcap: float | None = 0.0) -> torch.Tensor:
    """One query per sequence over its cached keys: ``q`` [B, H, D] -> [B, H, D] in q's dtype.

    Sequence ``b`` has ``lens[b]`` keys at positions ``0..lens[b]-1``, in blocks
    ``block_tables[b]`` ([B, W]) of the head-major caches ``[Hkv, blocks, block_size, D]``; its
    query sits at position ``lens[b] - 1``. ``window`` > 0 keeps keys ``j > lens[b] - 1 - window``;
    ``softcap`` > 0 maps scores to ``tanh(s / softcap) * softcap`` before the softmax. A row of
    length 0 gives zeros. Launches depend only on shapes (CUDA-graph safe): every row has
    :func:`decode_splits` programs per KV head and shares its own visible keys evenly among as
    many of them as it needs (:func:`row_splits`), whatever the table's width; ``lens`` must
    not exceed ``W * block_size`` (longer ones are clamped there) and table entries past a
    row's length are never read.
    """
    op = "decode_attention"
    heads, kv_heads, page, dim = _check_cache(op, q, k_cache, v_cache)
    _check_index(op, "block_tables", block_tables, 2, q.device)
    _check_index(op, "lens", lens, 1, q.device)
    batch, width = block_tables.shape
    if q.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(f"{op}: q ({q.shape[0]}), block_tables ({batch}) and lens ({lens.shape[0]}) "
                         "must have the same number of rows")
    qk_mul, cap_mul, window, has_cap, has_window = _score_args(op, scale, window, softcap)
    kernels, interpret = _launcher(op, q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or width == 0:
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = heads // kv_heads
    splits = decode_splits(batch, kv_heads, width * page)
    block_d = _pow2(dim)
    # the direct variant (one split) touches no partial buffer
    part_acc, part_m, part_l = _partials(batch, heads, splits, dim, q.device) if splits > 1 else (out, out, out)
    kernels.decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, lens, out, part_acc, part_m, part_l,
        qk_mul, cap_mul, window, splits, width,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1), lens.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, PAGE=page, BLOCK_G=_pow2(group), BLOCK_D=block_d, BLOCK_N=_DECODE_BLOCK_N,
        MIN_TILES=_MIN_SPLIT_TILES, SOFTCAP=has_cap, WINDOW=has_window, SPLIT=splits > 1,
        PRECISION=_precision(q.dtype), UPCAST=interpret,
        num_warps=4 if block_d <= 128 else 8, num_stages=2)
    if splits > 1:
        kernels.decode_reduce_kernel[(batch, heads)](
            part_acc, part_m, part_l, lens, out, window, splits, width, lens.stride(0), out.stride(0), out.stride(1),
            HEAD_DIM=dim, PAGE=page, BLOCK_S=_pow2(splits, 2), BLOCK_D=block_d, BLOCK_N=_DECODE_BLOCK_N,
            MIN_TILES=_MIN_SPLIT_TILES, WINDOW=has_window, num_warps=4)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor,
                      lens: torch.Tensor, contexts: torch.Tensor, tables: torch.Tensor, scale: float,
                      window: int | None = 0, softcap: float | None = 0.0,
                      max_len: int | None = None, invariant: bool = False) -> torch.Tensor:
    """Causal attention of every prefill chunk of a step, in one launch: ``q`` [T, H, D] -> [T, H, D].

    Chunk ``c`` owns batch rows ``starts[c] .. starts[c] + lens[c] - 1``, its queries at
    positions ``contexts[c] ..``; it attends keys ``0 .. contexts[c] + lens[c] - 1`` read from its
    blocks ``tables[c]`` ([C, W]) of the caches, its own already written there. Rows outside
    every chunk are zero. ``window``/``softcap`` as in :func:`decode_attention`. ``max_len``
    (at least the longest chunk, a host int the caller knows) sizes the grid; None reads
    ``lens.max()`` from the device (a sync). ``invariant`` (batch_invariant): each row's arithmetic
    independent of the rows it shares a query tile with (every key tile masked; see the kernels).
    """
    op = "prefill_attention"
    heads, kv_heads, page, dim = _check_cache(op, q, k_cache, v_cache)
    for name, t, dims in (("starts", starts, 1), ("lens", lens, 1), ("contexts", contexts, 1), ("tables", tables, 2)):
        _check_index(op, name, t, dims, q.device)
    chunks, width = tables.shape
    if not starts.shape[0] == lens.shape[0] == contexts.shape[0] == chunks:
        raise ValueError(f"{op}: starts ({starts.shape[0]}), lens ({lens.shape[0]}), contexts "
                         f"({contexts.shape[0]}) and tables ({chunks}) must have one entry per chunk")
    qk_mul, cap_mul, window, has_cap, has_window = _score_args(op, scale, window, softcap)
    kernels, interpret = _launcher(op, q)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if max_len is None:
        max_len = int(lens.max()) if chunks else 0
    if max_len < 0:
        raise ValueError(f"{op}: max_len must be >= 0; got {max_len}")
    if chunks == 0 or max_len == 0 or q.shape[0] == 0 or width == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = heads // kv_heads
    block_d = _pow2(dim)
    block_m, block_n, warps, stages = _prefill_config(q.dtype, block_d, group)
    block_q = block_m // group
    kernels.prefill_kernel[(_cdiv(max_len, block_q), chunks, kv_heads)](
        q, k_cache, v_cache, out, starts, lens, contexts, tables,
        qk_mul, cap_mul, window, width, q.shape[0],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0), tables.stride(1), starts.stride(0), lens.stride(0), contexts.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, PAGE=page, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=block_d, BLOCK_N=block_n,
        SOFTCAP=has_cap, WINDOW=has_window, PRECISION=_precision(q.dtype),
        UPCAST=interpret, INVARIANT=invariant,
        num_warps=warps, num_stages=stages)
    return out


def decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                lens: torch.Tensor, scale: float, window: int | None = 0,
                softcap: float | None = 0.0) -> torch.Tensor:
    """:func:`decode_attention`'s contract (a row of length 0 gives zeros) computed as batch_invariant needs
    it: each decode row is a one-token chunk of :func:`prefill_attention` with ``invariant``, so its
    arithmetic is exactly what its token gets inside a prefill chunk of any size (the same query tile
    shape, key tiles and online softmax; no split over the keys). Graph-safe: nothing read on the host.
    """
    op = "decode_rows"
    _check_index(op, "block_tables", block_tables, 2, q.device)
    _check_index(op, "lens", lens, 1, q.device)
    if q.shape[0] != block_tables.shape[0] or lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"{op}: q ({q.shape[0]}), block_tables ({block_tables.shape[0]}) and lens "
                         f"({lens.shape[0]}) must have the same number of rows")
    starts = torch.arange(q.shape[0], dtype=lens.dtype, device=q.device)
    return prefill_attention(q, k_cache, v_cache, starts, (lens > 0).to(lens.dtype), (lens - 1).clamp(min=0),
                             block_tables, scale, window, softcap, max_len=1, invariant=True)


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_rows: torch.Tensor, cu_q: torch.Tensor, ctx: torch.Tensor, scale: float,
                      window: int | None = 0, softcap: float | None = 0.0, invariant: bool = False) -> torch.Tensor:
    """Causal attention of a ragged step (prefill chunks and decodes alike), one launch: ``q`` [T, H, D] -> same.

    Sequence ``s`` of ``S`` owns batch rows ``cu_q[s] .. cu_q[s + 1] - 1`` (``cu_q`` [S + 1],
    non-decreasing from 0; a padding sequence owns none); its row ``j`` sits at position
    ``ctx[s] + j`` and attends keys ``0 .. ctx[s] + j`` (its own written already), read in place
    from the blocks in row ``seq_rows[s]`` of ``block_table`` [R, W]. A decode is a sequence of
    one row. Rows at or past ``cu_q[S]`` are padding and give zeros. ``window``/``softcap`` as in
    :func:`decode_attention`. The grid depends on ``T``, ``S`` and the shapes only, and nothing
    is read on the host, so a CUDA graph captured once replays with any split of up to ``T``
    rows among up to ``S`` sequences. Positions past ``W * block_size`` are never read; the
    index tensors' values are not checked (that would need a sync). ``invariant``: as in
    :func:`prefill_attention`.
    """
    op = "unified_attention"
    heads, kv_heads, page, dim = _check_cache(op, q, k_cache, v_cache)
    for name, t, dims in (("block_table", block_table, 2), ("seq_rows", seq_rows, 1), ("cu_q", cu_q, 1),
                          ("ctx", ctx, 1)):
        _check_index(op, name, t, dims, q.device)
    seqs, rows, width = seq_rows.shape[0], q.shape[0], block_table.shape[1]
    if cu_q.shape[0] != seqs + 1 or ctx.shape[0] != seqs:
        raise ValueError(f"{op}: for {seqs} sequences (seq_rows) cu_q must have {seqs + 1} entries and ctx "
                         f"{seqs}; got {cu_q.shape[0]} and {ctx.shape[0]}")
    qk_mul, cap_mul, window, has_cap, has_window = _score_args(op, scale, window, softcap)
    kernels, interpret = _launcher(op, q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    if seqs == 0 or width == 0:
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = heads // kv_heads
    block_d = _pow2(dim)
    block_m, block_n, warps, stages = _prefill_config(q.dtype, block_d, group)
    block_q = block_m // group
    kernels.unified_kernel[(_cdiv(rows, block_q) + seqs, kv_heads)](
        q, k_cache, v_cache, out, block_table, seq_rows, cu_q, ctx,
        qk_mul, cap_mul, window, width, rows, seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), block_table.stride(1), seq_rows.stride(0), cu_q.stride(0), ctx.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, PAGE=page, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_S=_pow2(seqs, 2), SOFTCAP=has_cap, WINDOW=has_window, PRECISION=_precision(q.dtype),
        UPCAST=interpret, INVARIANT=invariant,
        num_warps=warps, num_stages=stages)
    return out


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` [T, Hkv, D] at flat cache slots ``slot_mapping`` [T] (``block * block_size + row``).

    A negative slot skips its token (a graph bucket's padding rows). Values of ``v`` that are
    not finite are stored as 0, as the eager path stores them; ``k`` is stored as it is. Slots
    are not checked against the cache's size (that would need a sync).
    """
    op = "kv_write"
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{op}: k and v must both be [T, num_kv_heads, head_dim]; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_cache(op, k, k_cache, v_cache)
    if v.dtype != k.dtype:
        raise ValueError(f"{op}: v ({v.dtype}) must have k's dtype ({k.dtype})")
    if k.shape[1] != k_cache.shape[0]:
        raise ValueError(f"{op}: k and v have {k.shape[1]} heads, the cache {k_cache.shape[0]} KV heads")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache must have the same strides")
    _check_index(op, "slot_mapping", slot_mapping, 1, k.device)
    tokens = k.shape[0]
    if slot_mapping.shape[0] != tokens:
        raise ValueError(f"{op}: slot_mapping has {slot_mapping.shape[0]} entries for {tokens} tokens")
    kernels, _ = _launcher(op, k)
    if tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kv_heads, _, page, dim = k_cache.shape
    kernels.kv_write_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), slot_mapping.stride(0),
        KV_HEADS=kv_heads, HEAD_DIM=dim, PAGE=page, BLOCK_H=_pow2(kv_heads, 1), BLOCK_D=_pow2(dim),
        num_warps=4)
