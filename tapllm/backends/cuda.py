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
    return None
