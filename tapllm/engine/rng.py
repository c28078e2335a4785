"""Counter-based uniforms: one float64 in [0, 1) from a ``(seed, counter)`` pair, the same bits on
the host (NumPy) and on any torch device.

A draw depends on nothing but its pair: no generator state advances, so a request's uniform for
the token at index ``counter`` is the same whatever shares its batch, and a device can compute it
inside a CUDA graph (elementwise integer ops on static shapes, no host read).

The hash is Philox-like (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011):
the counter's two 32-bit halves (and two zero lanes) are the state, the seed's two halves the
key, and each of :data:`ROUNDS` rounds multiplies two lanes by odd constants, crosses the high
and low halves of the products with the other lanes and the key, and steps the key by Weyl
constants. Every lane is a 32-bit value held in an int64, and the multipliers are below 2**31,
so every product is below 2**63: neither NumPy nor torch overflows, and right shifts act on
non-negative values only (torch's are arithmetic), so both compute the same bits. The result
takes 53 bits of the final state, exactly representable in a float64, times 2**-53.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

ROUNDS = 10
_LANE = 0xFFFFFFFF
_MUL = (0x6C8E9CF5, 0x5D2B8A43)  # odd, below 2**31 (products of a 32-bit lane stay below 2**63)
_WEYL = (0x9E3779B9, 0xBB67AE85)  # key steps (added, then masked: no overflow)
_SCALE = 2.0 ** -53
_INT64_SPAN = 1 << 64

Lanes = TypeVar("Lanes", np.ndarray, torch.Tensor)


def as_int64(seed: int) -> int:
    """``seed`` (any integer in [-2**63, 2**64 - 1], the range ``SamplingParams.seed`` takes) as the
    int64 with the same low 64 bits."""
    if not -(1 << 63) <= seed < _INT64_SPAN:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")
    return seed - _INT64_SPAN if seed >= 1 << 63 else seed


def _bits53(seed: Lanes, counter: Lanes) -> Lanes:
    """53 random bits (an int64 in [0, 2**53)) per ``(seed, counter)``: the same code runs on NumPy
    int64 arrays and torch int64 tensors (their ``*``, ``>>``, ``^``, ``&``, ``+`` agree here).

    The four lanes are held as two pairs, ``even = (x0, x2)`` and ``odd = (x1, x3)`` (a leading
    axis of 2), so that a round is five whole-array ops: ``(x0, x2) * (M0, M1)`` gives the
    products ``(p0, p1)``; the new evens are ``(hi(p1) ^ x1 ^ k0, hi(p0) ^ x3 ^ k1)`` and the new
    odds ``(lo(p1), lo(p0))``, the halves of the products in swapped order.
    """
    host = isinstance(seed, np.ndarray)
    stack, flip = (np.stack, lambda a: a[::-1]) if host else (torch.stack, lambda a: a.flip(0))
    key = stack([seed & _LANE, (seed >> 32) & _LANE])
    odd = stack([(counter >> 32) & _LANE, counter * 0])
    even = stack([counter & _LANE, counter * 0])
    mul, weyl = _pair(_MUL, seed, host), _pair(_WEYL, seed, host)
    for _ in range(ROUNDS):
        product = even * mul
        even = flip(product >> 32) ^ odd ^ key
        odd = flip(product & _LANE)
        key = (key + weyl) & _LANE
    return ((even[0] >> 11) << 32) | odd[0]


def _pair(values: tuple[int, int], like: Lanes, host: bool) -> Lanes:
    """``values`` as a ``(2, 1, ...)`` int64 array or tensor that broadcasts against a stacked pair
    of ``like`` (on a device: made by a kernel, not copied from the host)."""
    shape = (2,) + (1,) * like.ndim
    first = np.arange(2, dtype=np.int64) if host else torch.arange(2, dtype=torch.int64, device=like.device)
    return (first * (values[1] - values[0]) + values[0]).reshape(shape)


def uniform_host(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) (float64) per ``(seeds[i], counters[i])`` (int64 arrays of one shape), on the host."""
    seeds, counters = np.asarray(seeds, dtype=np.int64), np.asarray(counters, dtype=np.int64)
    if seeds.shape != counters.shape:
        raise ValueError(f"seeds and counters must have one shape, got {seeds.shape} and {counters.shape}")
    return _bits53(seeds, counters).astype(np.float64) * _SCALE


def uniform_device(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """:func:`uniform_host` on ``seeds``' device: elementwise int64 ops only (no host read, static shapes)."""
    if seeds.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(f"seeds and counters must be int64 tensors, got {seeds.dtype} and {counters.dtype}")
    return _bits53(seeds, counters).double() * _SCALE
