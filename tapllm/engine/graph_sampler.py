"""Sampling a CUDA graph can hold: per-slot parameter tables on the device, static shapes, no host read.

:class:`SlotSampling` keeps each slot's temperature, top-k, top-p, min-p and seed in ``[slots]``
device tensors, written once when a request joins a slot (:meth:`SlotSampling.write`). Its
:meth:`SlotSampling.sample` takes a step's logits, each row's slot and each row's counter (the
index of the token it samples: the request's ``num_tokens``, which for a decode row is its
context length) and returns the tokens with the same ops as :meth:`SamplingPlan.sample
<tapllm.engine.sampler.SamplingPlan.sample>`, run on every row: rows whose parameters turn a
stage off pass through it unchanged, and every cut is by value, so the tokens are exactly the
plan's (ties included) for the same logits, parameters and counters. The uniforms come from
:func:`tapllm.engine.rng.uniform_device`, bit for bit the plan's host ones.

Logprobs and the logits controls (penalties, bias, bans, allowed ids, grammar masks) are not
here: they stay with the plan, outside any graph. A drawing step sorts every row twice (for
top-k, then top-p) where the plan sorts only the rows that use them: the price of static shapes.
"""

from __future__ import annotations

import numpy as np
import torch

from tapllm.engine.rng import as_int64, uniform_device
from tapllm.engine.sampler import NONFINITE, keep_nucleus
from tapllm.sampling_params import SamplingParams

# Columns of the int64 table: top-k, seed, then three float32 values packed in two int64s.
_TOP_K, _SEED, _FLOATS = 0, 1, 2
_TEMPERATURE, _TOP_P, _MIN_P = 0, 1, 2  # in the float32 view of the packed columns
_WIDTH = 4


class SlotSampling:
    """Per-slot sampling parameters on the device and a graph-safe sampler over them.

    Off values: temperature 0 (greedy), top_k 0, top_p 1, min_p 0. A slot never written is greedy.
    """

    def __init__(self, slots: int, vocab_size: int, device: torch.device) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.slots = slots
        self.vocab = vocab_size
        self.device = device
        # One int64 row per slot, so that a write is one copy; the columns are views of it.
        self.table = torch.zeros(slots, _WIDTH, dtype=torch.int64, device=device)
        floats = self.table[:, _FLOATS:].view(torch.float32)
        self.top_k = self.table[:, _TOP_K]
        self.seed = self.table[:, _SEED]
        self.temperature = floats[:, _TEMPERATURE]
        self.top_p = floats[:, _TOP_P]
        self.min_p = floats[:, _MIN_P]
        self.table.copy_(torch.from_numpy(np.stack([_row(SamplingParams(temperature=0.0), 0, vocab_size)] * slots)))

    def write(self, slot: int, params: SamplingParams, seed: int | None) -> None:
        """Set ``slot``'s parameters for the request joining it: one host-to-device copy of one row.

        The copy is ordered on the current stream after the work already queued there (steps of
        the slot's previous request still read its old values) and waits for it to finish, so call
        it between steps, not inside a graph. ``seed`` is required when ``params`` draw (not greedy).
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        if seed is None and not params.greedy:
            raise ValueError("seed is required for a request that samples at random (temperature > 0)")
        self.table[slot].copy_(torch.from_numpy(_row(params, 0 if seed is None else seed, self.vocab)))

    def pending_write(self, slot: int, params: SamplingParams, seed: int | None) -> tuple[torch.Tensor, np.ndarray]:
        """What :meth:`write` copies, as (device row, host values), for a step's upload to carry."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        if seed is None and not params.greedy:
            raise ValueError("seed is required for a request that samples at random (temperature > 0)")
        return self.table[slot], _row(params, 0 if seed is None else seed, self.vocab)

    # ---- on the device -----------------------------------------------------------------
    def sample(self, logits: torch.Tensor, slots: torch.Tensor, counters: torch.Tensor, draw: bool) -> torch.Tensor:
        """One result per row of ``logits`` [R, V]: float64, the token id, or ``-1`` where the row's
        logits are not all finite (``SamplingPlan``'s encoding of its token part).

        ``slots`` [R] (int64) are the rows' slots, ``counters`` [R] (int64) the index of the token
        each row samples. ``draw=False`` (every row is greedy: the caller knows) computes the
        argmax alone; rows written with a temperature are then taken greedily too.
        """
        values = logits.float()
        ok = torch.isfinite(values.amax(dim=-1)) & torch.isfinite(values.amin(dim=-1))
        tokens = values.argmax(dim=-1)
        if draw:
            temperature = self.temperature.index_select(0, slots)
            drawn = self._draw(values, slots, counters, temperature)
            tokens = torch.where(temperature > 0, drawn, tokens)
        return tokens.double().masked_fill(~ok, NONFINITE)

    def _draw(self, values: torch.Tensor, slots: torch.Tensor, counters: torch.Tensor,
              temperature: torch.Tensor) -> torch.Tensor:
        """A token per row, as ``SamplingPlan._draw`` picks it (greedy rows get one too, unused)."""
        top_k = self.top_k.index_select(0, slots)
        top_p = self.top_p.index_select(0, slots)
        min_p = self.min_p.index_select(0, slots)
        x = values / torch.where(temperature > 0, temperature, 1.0)[:, None]
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        x = x.masked_fill((top_k[:, None] > 0) & (x < kth), float("-inf"))
        probs = x.softmax(dim=-1)
        top = torch.sort(probs, dim=-1, descending=True).values
        nucleus = keep_nucleus(probs, top, top.cumsum(dim=-1), top_p)
        probs = torch.where((top_p < 1)[:, None], nucleus, probs)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        cdf = probs.double().cumsum(dim=-1)
        u = uniform_device(self.seed.index_select(0, slots), counters)[:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).clamp_(max=x.shape[-1] - 1).squeeze(1)


def _row(params: SamplingParams, seed: int, vocab_size: int) -> np.ndarray:
    """One slot's packed int64 row: top-k, seed, then temperature, top-p, min-p as float32 (and a pad)."""
    row = np.zeros(_WIDTH, dtype=np.int64)
    row[_TOP_K] = params.top_k if 0 < params.top_k < vocab_size else 0
    row[_SEED] = as_int64(seed)
    floats = row[_FLOATS:].view(np.float32)
    floats[_TEMPERATURE] = 0.0 if params.greedy else params.temperature
    floats[_TOP_P] = params.top_p
    floats[_MIN_P] = params.min_p
    return row
