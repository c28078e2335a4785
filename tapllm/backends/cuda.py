"""The CUDA backend's ops: tapllm's Triton kernels (attention over the paged KV cache; norms,
rotary and gated activations), each family behind a trial against the PyTorch reference."""

from __future__ import annotations

import torch

from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU, RMS_FLOAT_SCALE, RMS_GEMMA, RMS_LLAMA
from tapllm.tap.fused import HeadSites, KernelSites, NormSites


class TritonAttention:
    """:class:`~tapllm.backends.ops.AttentionOps` on the Triton kernels of ``tapllm.kernels.triton_attention``.

    ``invariant`` (batch_invariant): decode rows take ``decode_rows`` (one-token chunks of the prefill
    kernel) and every launch masks every key tile, so a token's attention is the same bits in a
    decode step, in a prefill chunk of any size and in a graph's unified step.
    """

    __slots__ = ("_k", "invariant")

    def __init__(self, invariant: bool = False) -> None:
        from tapllm.kernels import triton_attention

        self._k = triton_attention
        self.invariant = invariant

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._k.kv_write(k, v, k_cache, v_cache, slot_mapping)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int,
                         softcap: float) -> torch.Tensor:
        attend = self._k.decode_rows if self.invariant else self._k.decode_attention
        return attend(q, k_cache, v_cache, block_tables, lens, scale, window, softcap)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          starts: torch.Tensor, lens: torch.Tensor, contexts: torch.Tensor, tables: torch.Tensor,
                          scale: float, window: int, softcap: float, max_len: int) -> torch.Tensor:
        return self._k.prefill_attention(q, k_cache, v_cache, starts, lens, contexts, tables, scale, window,
                                         softcap, max_len, invariant=self.invariant)

    def unified_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_rows: torch.Tensor, cu_q: torch.Tensor, ctx: torch.Tensor,
                          scale: float, window: int, softcap: float) -> torch.Tensor:
        """A ragged step's prefill chunks and decodes in one graph-safe launch
        (:func:`tapllm.kernels.triton_attention.unified_attention`)."""
        return self._k.unified_attention(q, k_cache, v_cache, block_table, seq_rows, cu_q, ctx, scale, window,
                                         softcap, invariant=self.invariant)


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


class TritonElementwise:
    """:class:`~tapllm.backends.ops.FusedSiteOps` on the Triton kernels of ``tapllm.kernels.triton_elementwise``
    and ``triton_fused_sites``: the elementwise ops, rotary fused with the KV write, and the norms, rotary
    and gated activation with a graph step's tap sites inside."""

    __slots__ = ("_k", "_s")

    def __init__(self) -> None:
        from tapllm.kernels import triton_elementwise, triton_fused_sites

        self._k = triton_elementwise
        self._s = triton_fused_sites

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int) -> torch.Tensor:
        return self._k.rms_norm(x, weight, eps, mode)

    def add_rms_norm_(self, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                      mode: int) -> torch.Tensor:
        return self._k.add_rms_norm_(x, r, weight, eps, mode)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._k.rotary_(q, k, cos, sin)

    def rotary_kv_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
        self._k.rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def gated_act(self, gate_up: torch.Tensor, act: int) -> torch.Tensor:
        return self._k.gated_act(gate_up, act)

    def rms_norm_sites(self, x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float, mode: int,
                       sites: NormSites) -> torch.Tensor | None:
        return self._s.rms_norm_sites(x, r, weight, eps, mode, sites)

    def rotary_sites(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, sites: HeadSites) -> None:
        self._s.rotary_sites(q, k, v, cos, sin, write, sites)

    def gated_act_sites(self, gate_up: torch.Tensor, act: int, rows: KernelSites, site: int) -> torch.Tensor | None:
        return self._s.gated_act_sites(gate_up, act, rows, site)


class TritonMoE:
    """:class:`~tapllm.backends.ops.MoEOps` on the Triton kernels of ``tapllm.kernels.triton_moe``."""

    __slots__ = ("_k",)

    def __init__(self) -> None:
        from tapllm.kernels import triton_moe

        self._k = triton_moe

    def fused_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, act: int) -> torch.Tensor:
        return self._k.fused_experts(x, weights, ids, gate_up, down, act)


def moe_ops(device: torch.device) -> TritonMoE | None:
    """The fused expert kernels where Triton runs on ``device`` (they are tested against the grouped
    PyTorch path in tests/test_triton_moe.py), else None: the experts keep that path."""
    from tapllm.kernels import triton_moe  # (triton itself is imported by available(), which says False without it)

    return TritonMoE() if triton_moe.available(device) else None


def elementwise_trial(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run the elementwise kernels once on ``device`` in ``dtype`` (the model's) against the PyTorch
    reference; None when they agree, else why they cannot be used."""
    try:
        from tapllm.kernels import triton_elementwise
    except Exception as exc:  # noqa: BLE001 - any import failure means: the PyTorch ops
        return f"cannot import the Triton kernels: {type(exc).__name__}: {exc}"
    if not triton_elementwise.available(device):
        return f"Triton cannot run on {device}"
    try:
        return _compare_elementwise(device, dtype, TritonElementwise())
    except Exception as exc:  # noqa: BLE001 - a failed launch means: the PyTorch ops
        return f"trial failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"


# Kernel minus reference: float32 differs by the order of a sum; halves by a rounding flipped there.
_TRIAL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _compare_elementwise(device: torch.device, dtype: torch.dtype, ops: TritonElementwise) -> str | None:
    from tapllm.kernels import reference

    g = torch.Generator().manual_seed(0)
    tol = _TRIAL_TOL.get(dtype, _TRIAL_TOL[torch.float32])

    def rand(*shape: int, of: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(of).to(device)

    def differ(got: torch.Tensor, want: torch.Tensor) -> bool:
        return got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)

    x, r, w = rand(5, 200), rand(5, 200), rand(200)
    for mode in (RMS_LLAMA, RMS_FLOAT_SCALE, RMS_GEMMA):
        if differ(ops.rms_norm(x, w, 1e-5, mode), reference.rms_norm(x, w, 1e-5, mode)):
            return f"rms_norm mode {mode} disagrees with PyTorch ({dtype})"
    s = x.clone()
    out = ops.add_rms_norm_(s, r, w, 1e-5, RMS_LLAMA)
    if differ(s, x + r) or differ(out, reference.rms_norm(x + r, w, 1e-5, RMS_LLAMA)):
        return f"add_rms_norm_ disagrees with PyTorch ({dtype})"
    gate_up = rand(3, 2 * 150)
    for act in (ACT_SILU, ACT_GELU_TANH):
        if differ(ops.gated_act(gate_up, act), reference.gated_act(gate_up, act)):
            return f"gated_act mode {act} disagrees with PyTorch ({dtype})"
    heads, kv_heads, dim, page = 4, 2, 64, 16
    qkv = rand(4, (heads + 2 * kv_heads) * dim)  # q, k, v: strided views, as the model's
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(4, heads, dim), k.view(4, kv_heads, dim), v.view(4, kv_heads, dim)
    slots = torch.tensor([3, -1, 17, 40], device=device)
    for rot, of in ((dim, dtype), (dim, torch.float32), (dim // 2, dtype)):
        cos, sin = rand(4, rot, of=of), rand(4, rot, of=of)
        want_q, want_k = reference.rotary(q, k, cos, sin)
        q1, k1 = q.clone(), k.clone()
        ops.rotary_(q1, k1, cos, sin)
        if differ(q1, want_q) or differ(k1, want_k):
            return f"rotary_ rotary_dim {rot} (cos {of}) disagrees with PyTorch ({dtype})"
        caches = torch.zeros(2, kv_heads, 4, page, dim, dtype=dtype, device=device)
        q2, k2 = q.clone(), k.clone()
        ops.rotary_kv_write(q2, k2, v, cos, sin, caches[0], caches[1], slots)
        kept = slots >= 0
        stored = caches.view(2, kv_heads, -1, dim)[:, :, slots[kept]]
        if differ(q2, want_q) or differ(k2, want_k) or differ(stored[0], want_k[kept].transpose(0, 1)) \
                or differ(stored[1], v[kept].transpose(0, 1)) or caches.count_nonzero() != stored.count_nonzero():
            return f"rotary_kv_write rotary_dim {rot} (cos {of}) disagrees with PyTorch ({dtype})"
    return None
