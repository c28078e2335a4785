"""Plain-PyTorch definitions of every fused kernel: the probe's yardstick and the tests' reference.

Each function computes exactly what the eager model code computes at that place (same
roundings to the tensor dtype), so a kernel may differ from it only by summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU, RMS_FLOAT_SCALE, RMS_GEMMA, RMS_LLAMA


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mode: int) -> torch.Tensor:
    """RMSNorm of rows ``x`` [T, N]: Llama's order (``mode`` 0), scale in float32 (1), Gemma's ``1 + w`` (2)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if mode == RMS_LLAMA:
        return w * h.to(x.dtype)
    if mode == RMS_FLOAT_SCALE:
        return (w * h).to(x.dtype)
    return (h * (1.0 + w.float())).to(x.dtype)


def gated_act(gate_up: torch.Tensor, mode: int) -> torch.Tensor:
    """``act(gate) * up`` of ``[T, 2I]`` rows (gate first): SiLU (``mode`` 0) or tanh-GELU (1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if mode == ACT_SILU else F.gelu(gate, approximate="tanh")
    return act * up


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary on the first ``cos.shape[1]`` dims of each head; cos/sin are ``[T, R]`` rows."""
    r = cos.shape[1]

    def rot(x: torch.Tensor) -> torch.Tensor:
        head, rest = x[..., :r], x[..., r:]
        half = r // 2
        turned = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
        out = (head * cos[:, None] + turned * sin[:, None]).to(x.dtype)
        return torch.cat((out, rest), dim=-1)

    return rot(q), rot(k)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int, softcap: float) -> torch.Tensor:
    """One query per sequence over its cached keys, in float32: ``[B, H, D]``."""
    kv_heads, _, bs, d = k_cache.shape
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.cat([tables[b, p // bs : p // bs + 1] * bs + p % bs for p in range(n)])
        keys = k_cache.reshape(kv_heads, -1, d)[:, slots].float()  # [Hkv, n, D]
        vals = v_cache.reshape(kv_heads, -1, d)[:, slots].float()
        group = q.shape[1] // kv_heads
        qs = q[b].float().view(kv_heads, group, d)
        s = torch.einsum("hgd,hnd->hgn", qs, keys) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        if window > 0:
            s[..., : max(0, n - window)] = float("-inf")
        out[b] = torch.einsum("hgn,hnd->hgd", s.softmax(-1), vals).reshape(-1, d).to(q.dtype)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor,
                      lens: torch.Tensor, contexts: torch.Tensor, tables: torch.Tensor, scale: float, window: int,
                      softcap: float) -> torch.Tensor:
    """Causal attention of prefill chunks (queries at positions ``context..context + len``) over their
    cached keys, in float32: ``[T, H, D]`` (rows outside every chunk are zero)."""
    kv_heads, _, bs, d = k_cache.shape
    out = torch.zeros_like(q)
    for c in range(starts.shape[0]):
        s0, n, ctx = int(starts[c]), int(lens[c]), int(contexts[c])
        total = ctx + n
        slots = torch.tensor([int(tables[c, p // bs]) * bs + p % bs for p in range(total)])
        keys = k_cache.reshape(kv_heads, -1, d)[:, slots].float()  # [Hkv, total, D]
        vals = v_cache.reshape(kv_heads, -1, d)[:, slots].float()
        group = q.shape[1] // kv_heads
        qs = q[s0 : s0 + n].float().view(n, kv_heads, group, d)
        scores = torch.einsum("nhgd,hkd->nhgk", qs, keys) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(ctx, total)[:, None]
        kpos = torch.arange(total)[None, :]
        allowed = kpos <= qpos
        if window > 0:
            allowed &= kpos > qpos - window
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        out[s0 : s0 + n] = torch.einsum("nhgk,hkd->nhgd", scores.softmax(-1), vals).reshape(n, -1, d).to(q.dtype)
    return out


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def quant_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act_bits: int = 0) -> torch.Tensor:
    """A quantized linear: ``x`` (rounded to int8 per 32 values when ``act_bits`` is 8) times the
    float32 weight that blocks ``w`` stand for."""
    from tapllm.quant.pack import dequantize, round_activations

    deq = dequantize(w, x.shape[-1])
    xf = round_activations(x) if act_bits else x.float()
    return F.linear(xf, deq, None if bias is None else bias.float()).to(x.dtype)


def _check_quant(ops: Any, rand: Any, dtype: torch.dtype, tol: float) -> str | None:
    from tapllm.quant.pack import quantize_int4, quantize_int8

    w = rand(21, 64).float()
    cases = [(quantize_int4(w, 32), 64), (quantize_int8(w), 64), (quantize_int8(w, 32), 64)]
    # GGUF Q4_K, Q6_K: any bytes are valid blocks once d (and dmin) are finite; weights ~0.1-1
    for nbytes, scales, d in ((144, slice(0, 4), 1e-3), (210, slice(208, 210), 1e-4)):
        k_blocks = (rand(21, 1, nbytes).float().abs() * 60).to(torch.uint8)
        k_blocks[..., scales] = torch.full((21, 1, (scales.stop - scales.start) // 2), d,
                                           dtype=torch.float16).view(torch.uint8).view(21, 1, -1)
        cases.append((k_blocks, 256))
    for packed, k in cases:
        for m in (1, 5, 18):  # the fused rows and the dequantize-then-GEMM path
            x, b = rand(m, k), rand(21)
            for bits in (0, 8):
                if not _close(ops.quant_linear(x, packed, b, bits), quant_linear(x, packed, b, bits), tol * 4):
                    return f"quant_linear blocks {tuple(packed.shape[1:])} rows={m} act_bits={bits} ({dtype})"
    return None


def check_all(ops: Any) -> str | None:
    """Run every op of ``ops`` on small random inputs in float32 and bfloat16; the first mismatch, or None."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)):
        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(dtype)

        x, w = rand(5, 40), rand(40)
        for mode in (RMS_LLAMA, RMS_FLOAT_SCALE, RMS_GEMMA):
            if not _close(ops.rms_norm(x, w, 1e-5, mode), rms_norm(x, w, 1e-5, mode), tol):
                return f"rms_norm mode {mode} ({dtype})"
        r = rand(5, 40)
        x2 = x.clone()
        out = ops.add_rms_norm_(x2, r, w, 1e-5, RMS_LLAMA)
        if not _close(x2, x + r, tol) or not _close(out, rms_norm(x + r, w, 1e-5, RMS_LLAMA), tol):
            return f"add_rms_norm_ ({dtype})"
        gu = rand(3, 2 * 37)
        for mode in (ACT_SILU, ACT_GELU_TANH):
            if not _close(ops.gated_act(gu, mode), gated_act(gu, mode), tol):
                return f"gated_act mode {mode} ({dtype})"
        qkv = rand(4, 3 * 24 + 2 * 24)
        q, k = qkv[:, :72].view(4, 3, 24), qkv[:, 72:96].view(4, 1, 24)
        cos, sin = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        for c, s in ((cos.to(dtype), sin.to(dtype)), (cos, sin)):
            rq, rk = rotary(q, k, c, s)
            q2, k2 = q.clone(), k.clone()
            ops.rotary_(q2, k2, c, s)
            if not _close(q2, rq, tol) or not _close(k2, rk, tol):
                return f"rotary_ ({dtype}, cos {c.dtype})"
        kc, vc = torch.zeros(2, 6, 4, 16, dtype=dtype), torch.zeros(2, 6, 4, 16, dtype=dtype)
        kk, vv = rand(9, 2, 16), rand(9, 2, 16)
        vv[0, 0, 0] = float("nan")
        slots = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10, 20])
        ops.kv_write(kk, vv, kc, vc, slots)
        if not _close(kc.view(2, -1, 16)[:, slots], kk.transpose(0, 1), 0) or \
                not _close(vc.view(2, -1, 16)[:, slots], torch.nan_to_num(vv, nan=0.0).transpose(0, 1), 0):
            return f"kv_write ({dtype})"
        tables = torch.tensor([[0, 1, 0], [2, 5, 0]])
        lens = torch.tensor([5, 7])
        qd = rand(2, 4, 16)
        for window, cap in ((0, 0.0), (3, 0.0), (0, 5.0)):
            want = decode_attention(qd, kc, vc, tables, lens, 0.25, window, cap)
            for name in ("decode_attention", "row_attention"):
                if not _close(getattr(ops, name)(qd, kc, vc, tables, lens, 0.25, window, cap), want, tol):
                    return f"{name} window={window} softcap={cap} ({dtype})"
        qp = rand(9, 4, 16)
        starts, plens, ctxs = torch.tensor([0, 4]), torch.tensor([4, 5]), torch.tensor([1, 2])
        for window, cap in ((0, 0.0), (3, 0.0), (0, 5.0)):
            got = ops.prefill_attention(qp, kc, vc, starts, plens, ctxs, tables, 0.25, window, cap)
            want = prefill_attention(qp, kc, vc, starts, plens, ctxs, tables, 0.25, window, cap)
            if not _close(got, want, tol):
                return f"prefill_attention window={window} softcap={cap} ({dtype})"
        # head size 64 over several 64-key tiles: the bfloat16 dot-product and AMX tile tasks
        kc64, vc64 = rand(2, 12, 16, 64), rand(2, 12, 16, 64)
        q64 = rand(50, 4, 64)
        tables64 = torch.tensor([[3, 0, 7, 1, 9, 2, 5], [11, 4, 8, 6, 10, 0, 0]])
        starts, plens, ctxs = torch.tensor([0, 30]), torch.tensor([30, 20]), torch.tensor([70, 0])
        for window in (0, 40):
            got = ops.prefill_attention(q64, kc64, vc64, starts, plens, ctxs, tables64, 0.125, window, 0.0)
            want = prefill_attention(q64, kc64, vc64, starts, plens, ctxs, tables64, 0.125, window, 0.0)
            if not _close(got, want, tol):
                return f"prefill_attention head size 64 window={window} ({dtype})"
        problem = _check_quant(ops, rand, dtype, tol)
        if problem:
            return problem
    return None


def tap_site(x: torch.Tensor, site: Any, tables: Any, row_slot: torch.Tensor, positions: torch.Tensor) -> None:
    """A graph step's tap at ``site`` (``tapllm.tap.sites.Site``), row by row from ``tables``
    (``tapllm.tap.tables.TapTables``): each operation rounded to ``x``'s dtype, then the capture."""
    from tapllm.tap.tables import OP_ADD, OP_DIRECTION, OP_SCALE

    for r in range(x.shape[0]):
        slot, pos = int(row_slot[r]), int(positions[r])
        row = x[r].reshape(site.groups, site.group_width)
        xf = row.float()
        first, count = int(tables.st_first[slot, site.index]), int(tables.st_count[slot, site.index])
        for i in range(first, first + count):
            kind, lo, hi, prow, stride = (int(v) for v in tables.ops[i])
            if not lo <= pos < hi:
                continue
            v = tables.pool[prow + (pos - lo) * stride, : site.width].reshape(site.groups, site.group_width)
            if kind == OP_ADD:
                xf = xf + v
            elif kind == OP_SCALE:
                xf = xf * v
            elif kind == OP_DIRECTION:
                xf = xf + (float(tables.op_value[i]) - (xf * v).sum(-1, keepdim=True)) * v
            else:
                xf = torch.where(torch.isnan(v), xf, v)
            xf = xf.to(x.dtype).float()
        if count:
            row.copy_(xf.to(x.dtype))
        base, off = int(tables.row_base[r]), int(tables.cap_off[slot, site.index])
        if base >= 0 and off >= 0:
            tables.cap_out[base + off : base + off + site.width].copy_(xf.reshape(-1).to(tables.cap_out.dtype))
