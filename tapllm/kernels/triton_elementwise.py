"""The elementwise ops of a block in Triton: the CUDA backend's norms, rotary and gated activations.

Each op computes what its plain-PyTorch definition in :mod:`tapllm.kernels.reference` computes,
with the same roundings to the tensor dtype, in one launch:

- :func:`rms_norm` and :func:`add_rms_norm_` (the residual add in place, then the norm of the
  sum) in the three orders of :mod:`tapllm.kernels.constants` (Llama's, scale in float32,
  Gemma's ``1 + w``); one program per row, the row held in one tile up to
  :data:`ONE_PASS_WIDTH` columns and read twice in tiles beyond;
- :func:`rotary_` in place on q and k, which may be strided views into the fused qkv
  projection; :func:`rotary_kv_write` also stores the rotated keys and the values into the paged
  cache (what :func:`tapllm.kernels.triton_attention.kv_write` does), so a layer's K/V write
  costs no launch of its own;
- :func:`gated_act`: ``act(gate) * up`` of ``[gate | up]`` rows, SiLU or GELU's tanh form.

Launches depend on shapes only (no value is read on the host), so a CUDA graph captured once
replays with new inputs in the same buffers. Triton is imported only when an op runs or
:func:`available` is asked; with ``TRITON_INTERPRET=1`` set before triton is imported the
kernels run in Triton's interpreter, on CPU tensors too (the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU, RMS_FLOAT_SCALE, RMS_GEMMA, RMS_LLAMA
from tapllm.kernels.triton_attention import _check_cache, _check_index
from tapllm.kernels.triton_modules import kernels_module, runs_on

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Norm rows up to this many columns are held in one tile (one read of x); wider ones are read
# twice in tiles of _NORM_TILE.
ONE_PASS_WIDTH = 16384
_NORM_TILE = 4096
# Columns of a gated activation per program; (head, dim) elements per rotary program, about.
_ACT_TILE = 1024
_ROTARY_ELEMENTS = 2048


def _kernels() -> Any | None:
    """The kernels' module (importing triton), or None when triton cannot be imported."""
    return kernels_module("triton_elementwise_kernels")


def available(device: torch.device | str | torch.Tensor) -> bool:
    """Whether the kernels can run on ``device`` (or a tensor's device): triton is importable and
    the device is CUDA, or it is the CPU and Triton's interpreter is on (``TRITON_INTERPRET=1``
    before triton is first imported)."""
    return runs_on(_kernels(), device)


def _launcher(op: str, t: torch.Tensor) -> tuple[Any, bool]:
    """The kernels' module for ``op`` on tensors like ``t``, and whether bfloat16 rounding is emulated
    (Triton's interpreter truncates float32 to bfloat16: see the kernels' module)."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError(f"{op}: triton cannot be imported (pip install triton)")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and kernels.INTERPRETED):
        raise ValueError(f"{op}: tensors must be on a CUDA device, or on the CPU with Triton's interpreter on "
                         f"(TRITON_INTERPRET=1 before triton is imported); got {t.device}")
    return kernels, kernels.INTERPRETED and t.dtype == torch.bfloat16


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_rows(op: str, name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """``t`` is ``[T, N]`` rows of a supported dtype with contiguous columns (shaped and typed as ``like``)."""
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D rows [T, N]; got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{op}: {name} must be float16, bfloat16 or float32; got {t.dtype}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{op}: {name}'s rows must be contiguous (stride 1 along the last dim); "
                         f"got strides {t.stride()}")
    if like is not None:
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"{op}: {name} must match x ({tuple(like.shape)} {like.dtype}); "
                             f"got {tuple(t.shape)} {t.dtype}")
        if t.device != like.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {like.device}")


def check_norm(op: str, x: torch.Tensor, w: torch.Tensor, mode: int) -> None:
    """``x`` is rows of at least one column, ``w`` its weight (contiguous, x's dtype and device), ``mode`` a
    norm order of :mod:`tapllm.kernels.constants`."""
    check_rows(op, "x", x)
    if x.shape[1] < 1:
        raise ValueError(f"{op}: x must have at least one column")
    if w.dim() != 1 or w.shape[0] != x.shape[1] or w.dtype != x.dtype:
        raise ValueError(f"{op}: weight must be [{x.shape[1]}] of x's dtype {x.dtype}; "
                         f"got {tuple(w.shape)} {w.dtype}")
    if w.stride(0) != 1 and w.shape[0] > 1:
        raise ValueError(f"{op}: weight must be contiguous")
    if w.device != x.device:
        raise ValueError(f"{op}: weight is on {w.device}, x on {x.device}")
    if mode not in (RMS_LLAMA, RMS_FLOAT_SCALE, RMS_GEMMA):
        raise ValueError(f"{op}: mode must be {RMS_LLAMA} (Llama), {RMS_FLOAT_SCALE} (scale in float32) "
                         f"or {RMS_GEMMA} (Gemma); got {mode}")


def _norm(op: str, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float, mode: int) -> torch.Tensor:
    kernels, emulate = _launcher(op, x)
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    one_pass = width <= ONE_PASS_WIDTH
    block = _pow2(width) if one_pass else _NORM_TILE
    kernels.rms_norm_kernel[(rows,)](
        x, x if r is None else r, w, out, width, float(eps),
        x.stride(0), 0 if r is None else r.stride(0), out.stride(0),
        MODE=mode, ADD=r is not None, BLOCK=block, ONE_PASS=one_pass, EMULATE_RNE=emulate,
        num_warps=min(16, max(1, block // 512)))
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mode: int) -> torch.Tensor:
    """RMSNorm of rows ``x`` [T, N] with weight ``w`` [N] in ``mode``'s order -> [T, N] in x's dtype
    (:func:`tapllm.kernels.reference.rms_norm`)."""
    check_norm("rms_norm", x, w, mode)
    return _norm("rms_norm", x, None, w, eps, mode)


def add_rms_norm_(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float, mode: int) -> torch.Tensor:
    """``x += r`` in place (rounded to x's dtype, as ``x + r`` is), and returns the RMSNorm of the
    new ``x`` (as :func:`rms_norm`), in one pass over the rows."""
    op = "add_rms_norm_"
    check_norm(op, x, w, mode)
    check_rows(op, "r", r, like=x)
    return _norm(op, x, r, w, eps, mode)


def check_heads(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate q [T, H, D], k [T, Hkv, D] and cos/sin [T, R]; returns R."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"{op}: q and k must be [T, heads, head_dim] with the same T and head_dim; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"{op}: q and k must share one dtype of float16/bfloat16/float32; got {q.dtype}, {k.dtype}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1 and t.shape[2] > 1:
            raise ValueError(f"{op}: {name}'s heads must be contiguous (stride 1 along head_dim); "
                             f"got strides {t.stride()}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
    tokens, dim = q.shape[0], q.shape[2]
    if cos.dim() != 2 or sin.shape != cos.shape or cos.shape[0] != tokens:
        raise ValueError(f"{op}: cos and sin must both be [{tokens}, rotary_dim]; "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rot = cos.shape[1]
    if rot < 2 or rot % 2 or rot > dim:
        raise ValueError(f"{op}: rotary_dim (cos.shape[1]) must be even, at least 2 and at most head_dim {dim}; "
                         f"got {rot}")
    if cos.dtype not in _DTYPES or sin.dtype != cos.dtype:
        raise ValueError(f"{op}: cos and sin must share one dtype of float16/bfloat16/float32; "
                         f"got {cos.dtype}, {sin.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
    return rot


def rotary_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor | None,
                  write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> tuple[tuple, tuple, dict]:
    """``(grid, arguments, constexprs)`` of ``rotary_kernel`` on checked tensors (``v``: the values, with
    ``write`` ``(k_cache, v_cache, slot_mapping)`` where they are stored); the launch of ``tokens > 0``."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    block_d = _pow2(dim, 16)
    block_h = min(_pow2(max(kv_heads, 1)), max(1, _ROTARY_ELEMENTS // block_d))
    q_blocks = _cdiv(heads, block_h)
    # Eager multiplies in the promoted dtype of q and cos, a half only when both are that half: products
    # and sum are rounded there; any other pair computes in float32.
    rounded = cos.dtype == q.dtype != torch.float32
    v = q if v is None else v  # untouched then
    if write is None:
        k_cache, v_cache, slots, page = q, q, cos, 1  # untouched without WRITE
        cache_strides = (0, 0, 0)
    else:
        k_cache, v_cache, slots = write
        page = k_cache.shape[2]
        cache_strides = k_cache.stride()[:3]
    args = (q, k, v, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_blocks,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), *cache_strides, slots.stride(0))
    constexprs = dict(HEAD_DIM=dim, ROT=cos.shape[1], PAGE=page, BLOCK_H=block_h, BLOCK_D=block_d, ROUND=rounded,
                      WRITE=write is not None)
    return (tokens, q_blocks + _cdiv(kv_heads, block_h)), args, constexprs


def _rotary(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    kernels, emulate = _launcher(op, q)
    if q.shape[0] == 0:
        return
    grid, args, constexprs = rotary_launch(q, k, cos, sin, None if write is None else write[0],
                                           None if write is None else write[1:])
    kernels.rotary_kernel[grid](*args, **constexprs, EMULATE_RNE=emulate, num_warps=4)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half rotary in place on the first ``R = cos.shape[1]`` dims of every head of ``q``
    [T, H, D] and ``k`` [T, Hkv, D] (strided views welcome: rows and heads may have any stride);
    cos/sin are ``[T, R]`` rows (:func:`tapllm.kernels.reference.rotary`)."""
    op = "rotary_"
    check_heads(op, q, k, cos, sin)
    _rotary(op, q, k, cos, sin, None)


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`rotary_` on ``q`` and ``k``, and the rotated ``k`` and ``v`` [T, Hkv, D] stored at flat
    slots ``slot_mapping`` [T] of the head-major caches ``[Hkv, blocks, block_size, D]``, in one
    launch: what ``rotary_`` then :func:`tapllm.kernels.triton_attention.kv_write` do (a negative
    slot skips its token; values of ``v`` that are not finite are stored as 0)."""
    op = "rotary_kv_write"
    check_heads(op, q, k, cos, sin)
    check_values(op, q, k, v)
    check_kv_write(op, q, k, k_cache, v_cache, slot_mapping)
    _rotary(op, q, k, cos, sin, (v, k_cache, v_cache, slot_mapping))


def check_values(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``v`` is shaped and typed as ``k``, with contiguous heads, on q's device."""
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"{op}: v must match k ({tuple(k.shape)} {k.dtype}); got {tuple(v.shape)} {v.dtype}")
    if v.stride(2) != 1 and v.shape[2] > 1:
        raise ValueError(f"{op}: v's heads must be contiguous (stride 1 along head_dim); got strides {v.stride()}")
    if v.device != q.device:
        raise ValueError(f"{op}: v is on {v.device}, q on {q.device}")


def check_kv_write(op: str, q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """The caches and slots of a K/V write of ``k``'s tokens."""
    if k_cache.dim() == 4 and k.shape[1] != k_cache.shape[0]:
        raise ValueError(f"{op}: k and v have {k.shape[1]} heads, the cache {k_cache.shape[0]} KV heads")
    _check_cache(op, k, k_cache, v_cache)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache must have the same strides")
    _check_index(op, "slot_mapping", slot_mapping, 1, q.device)
    if slot_mapping.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: slot_mapping has {slot_mapping.shape[0]} entries for {q.shape[0]} tokens")


def gated_act(gate_up: torch.Tensor, mode: int) -> torch.Tensor:
    """``act(gate) * up`` of rows ``gate_up`` [T, 2I] (gate first) -> [T, I]: SiLU (``mode`` 0) or
    GELU's tanh form (1) (:func:`tapllm.kernels.reference.gated_act`)."""
    op = "gated_act"
    check_rows(op, "gate_up", gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"{op}: gate_up must have an even number of columns [gate | up]; got {width}")
    if mode not in (ACT_SILU, ACT_GELU_TANH):
        raise ValueError(f"{op}: mode must be {ACT_SILU} (SiLU) or {ACT_GELU_TANH} (GELU, tanh form); got {mode}")
    kernels, emulate = _launcher(op, gate_up)
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    block = min(_pow2(inter, 16), _ACT_TILE)
    kernels.gated_act_kernel[(rows, _cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0),
        ACT=mode, BLOCK=block, EMULATE_RNE=emulate, num_warps=4)
    return out
