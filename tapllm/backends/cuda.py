"""The CUDA backend's attention: tapllm's Triton kernels over the paged KV cache, behind a trial."""

from __future__ import annotations

import torch


class TritonAttention:
    """:class:`~tapllm.backends.ops.AttentionOps` on the Triton kernels of ``tapllm.kernels.triton_attention``."""

    __slots__ = ("_k",)

    def __init__(self) -> None:
        from tapllm.kernels import triton_attention

        self._k = triton_attention

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._k.kv_write(k, v, k_cache, v_cache, slot_mapping)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int,
                         softcap: float) -> torch.Tensor:
        return self._k.decode_attention(q, k_cache, v_cache, block_tables, lens, scale, window, softcap)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          starts: torch.Tensor, lens: torch.Tensor, contexts: torch.Tensor, tables: torch.Tensor,
                          scale: float, window: int, softcap: float, max_len: int) -> torch.Tensor:
        return self._k.prefill_attention(q, k_cache, v_cache, starts, lens, contexts, tables, scale, window,
                                         softcap, max_len)

    def unified_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_rows: torch.Tensor, cu_q: torch.Tensor, ctx: torch.Tensor,
                          scale: float, window: int, softcap: float) -> torch.Tensor:
        """A ragged step's prefill chunks and decodes in one graph-safe launch
        (:func:`tapllm.kernels.triton_attention.unified_attention`)."""
        return self._k.unified_attention(q, k_cache, v_cache, block_table, seq_rows, cu_q, ctx, scale, window,
                                         softcap)


def trial(device: torch.device) -> str | None:
    """Run the kernels once on ``device`` against the PyTorch reference; None when they agree,
    else why they cannot be used (not importable, a launch failed, a mismatch)."""
    try:
        from tapllm.kernels import triton_attention
    except Exception as exc:  # noqa: BLE001 - any import failure means: the PyTorch step
        return f"cannot import the Triton kernels: {type(exc).__name__}: {exc}"
    if not triton_attention.available(device):
        return f"Triton cannot run on {device}"
    try:
        return _compare(device, TritonAttention())
    except Exception as exc:  # noqa: BLE001 - a failed launch means: the PyTorch step
        return f"trial failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"


def _compare(device: torch.device, ops: TritonAttention) -> str | None:
    from tapllm.layers.attention import AttentionMetadata, AttentionOptions, PrefillBatch, PrefillChunk, paged_attention

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 4, 2, 64, 16, 12
    opts = AttentionOptions(scale=dim**-0.5)
    lens = [1, 17, 40]  # decode rows: tokens in the cache including the new one
    tables = [[3, 0, 0], [5, 1, 0], [7, 2, 9]]
    errs = []
    for attn in (None, ops):
        g.manual_seed(0)  # the same cache and inputs for both
        k_cache = torch.randn(kv_heads, blocks, bs, dim, generator=g).to(device)
        v_cache = torch.randn(kv_heads, blocks, bs, dim, generator=g).to(device)
        q = torch.randn(3, heads, dim, generator=g).to(device)
        k = torch.randn(3, kv_heads, dim, generator=g).to(device)
        v = torch.randn(3, kv_heads, dim, generator=g).to(device)
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
        lens_t = torch.tensor(lens, device=device)
        width = 3 * bs
        mask = (torch.arange(width, device=device)[None, :] >= lens_t[:, None])[:, None, :]
        meta = AttentionMetadata(torch.tensor(slots, device=device), 3, torch.tensor(tables, device=device),
                                 mask, [], decode_lens=lens_t, attn=attn)
        decode = paged_attention(q, k, v, k_cache, v_cache, meta, opts)
        chunk = PrefillChunk(0, 3, 20, torch.tensor(tables[2], device=device))
        pslots = [tables[2][p // bs] * bs + p % bs for p in (20, 21, 22)]
        pmeta = AttentionMetadata(torch.tensor(pslots, device=device), 0, None, None,
                                  [] if attn is not None else [chunk], attn=attn,
                                  prefill_batch=PrefillBatch.build([chunk], [tables[2]], device, 3)
                                  if attn is not None else None)
        prefill = paged_attention(q, k, v, k_cache, v_cache, pmeta, opts)
        errs.append((decode.float(), prefill.float()))
    for name, want, got in (("decode", errs[0][0], errs[1][0]), ("prefill", errs[0][1], errs[1][1])):
        err = float((got - want).abs().max() / want.abs().max())  # a trial at load, not inside a step
        if not err < 1e-4:
            return f"{name} attention disagrees with PyTorch ({err:.1e})"
    return _compare_unified(device, ops)


def _compare_unified(device: torch.device, ops: TritonAttention) -> str | None:
    """A mixed step (two decodes, a fresh prompt, a chunk over cached context, then padding rows and
    sequences) through :meth:`TritonAttention.unified_attention` against the PyTorch step."""
    from tapllm.layers.attention import AttentionMetadata, AttentionOptions, PrefillChunk, paged_attention

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs, blocks = 4, 2, 64, 16, 12
    tables = [[3, 0, 0], [5, 1, 0], [7, 2, 9], [4, 6, 8]]
    seqs = [(0, 1), (16, 1), (0, 5), (20, 3)]  # (tokens cached before the step, new tokens)
    rows = sum(n for _, n in seqs)
    k_cache = torch.randn(kv_heads, blocks, bs, dim, generator=g).to(device)
    v_cache = torch.randn(kv_heads, blocks, bs, dim, generator=g).to(device)
    q = torch.randn(rows + 2, heads, dim, generator=g).to(device)
    k = torch.randn(rows, kv_heads, dim, generator=g).to(device)
    v = torch.randn(rows, kv_heads, dim, generator=g).to(device)
    slots = [t[p // bs] * bs + p % bs for t, (c, n) in zip(tables, seqs) for p in range(c, c + n)]
    lens = torch.tensor([c + 1 for c, _ in seqs[:2]], device=device)
    mask = (torch.arange(3 * bs, device=device)[None, :] >= lens[:, None])[:, None, :]
    chunks = [PrefillChunk(2, 5, 0, None), PrefillChunk(7, 3, 20, torch.tensor(tables[3], device=device))]
    index = dict(dtype=torch.int32, device=device)
    table = torch.tensor(tables + [[11, 11, 11]], **index)  # a row of no sequence in the step
    seq_rows, cu_q = torch.tensor([0, 1, 2, 3, 4, 4], **index), torch.tensor([0, 1, 2, 7, 10, 10, 10], **index)
    ctx = torch.tensor([c for c, _ in seqs] + [0, 0], **index)
    for opts in (AttentionOptions(scale=dim**-0.5), AttentionOptions(scale=dim**-0.5, window=4, softcap=5.0)):
        meta = AttentionMetadata(torch.tensor(slots, device=device), 2, torch.tensor(tables[:2], device=device),
                                 mask, chunks, decode_lens=lens)
        want = paged_attention(q[:rows], k, v, k_cache, v_cache, meta, opts)  # writes the step's keys
        got = ops.unified_attention(q, k_cache, v_cache, table, seq_rows, cu_q, ctx, opts.scale, opts.window or 0,
                                    opts.softcap or 0.0)
        err = float((got[:rows] - want).abs().max() / want.abs().max())
        if not err < 1e-4:
            return f"unified attention disagrees with PyTorch ({err:.1e}; window={opts.window}, softcap={opts.softcap})"
        if not bool((got[rows:] == 0).all()):
            return "unified attention left padding rows that are not zero"
    return None
