"""vLLM's logits controls, applied to the rows of a step that use them, vectorised over those rows.

Each request with a control carries a ``LogitsControls`` resolved once at admission (token
ids checked against the vocabulary, bad words tokenized). Per step, :func:`apply_controls`
gathers the rows that use any control into one ``[m, vocab]`` float32 tensor and applies each
control to the rows that want it with a handful of tensor operations (an ``index_put_`` of
the (row, token) pairs to ban or bias, a masked fill for allowed ids, a gather of the rows'
token counts for the penalties). Requests without controls are never gathered, so a step
without any pays nothing.

Penalty state lives in :class:`TokenCounts`, on the model's device: one row per sample that
uses penalties, holding its output-token counts (updated in place after each sampled token
with one ``index_put_`` of the device's sampled ids) and its prompt's token set (for
``repetition_penalty``), so nothing is rebuilt per step.

The controls run where the logits are. A row's ids are listed on the host and go to the
device with the step (a copy that only steps with controls make); nothing reads a device
value back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tapllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(slots=True, frozen=True)
class LogitsControls:
    """One request's logits controls, resolved against the vocabulary (shared by its samples)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias_ids: torch.Tensor | None = None  # long [k]
    bias_values: torch.Tensor | None = None  # float32 [k]
    allowed: torch.Tensor | None = None  # long [k]
    banned: torch.Tensor | None = None  # long: single-token bad words, always banned
    bad_sequences: tuple[tuple[tuple[int, ...], int], ...] = ()  # (prefix, last token) of longer bad words
    min_tokens: int = 0
    stop_ids: torch.Tensor | None = None  # long: banned until min_tokens are generated

    @property
    def penalized(self) -> bool:
        """True when a penalty is on (the request then needs a ``TokenCounts`` row)."""
        return bool(self.presence or self.frequency or self.repetition != 1.0)


def resolve_controls(params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int],
                     bad_words_ids: Sequence[Sequence[int]]) -> LogitsControls | None:
    """The request's controls checked against the vocabulary; ``None`` when it uses none.

    ``bad_words_ids`` are the tokenized bad words (see :func:`tokenize_bad_words`).
    """
    if not params.has_logits_controls:
        return None

    def ids(values: Sequence[int], name: str) -> torch.Tensor:
        bad = next((t for t in values if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        return torch.tensor(sorted(set(values)), dtype=torch.long)

    bias_ids = bias_values = allowed = banned = stop_ids = None
    if params.logit_bias:
        keys = list(params.logit_bias)
        ids(keys, "logit_bias")
        bias_ids = torch.tensor(keys, dtype=torch.long)
        bias_values = torch.tensor([float(params.logit_bias[k]) for k in keys], dtype=torch.float32)
    if params.allowed_token_ids:
        allowed = ids(params.allowed_token_ids, "allowed_token_ids")
    singles = [w[0] for w in bad_words_ids if len(w) == 1]
    if singles:
        banned = torch.tensor(sorted(set(singles)), dtype=torch.long)
    sequences = tuple((tuple(w[:-1]), w[-1]) for w in bad_words_ids if len(w) > 1)
    if params.min_tokens:
        stops = list(params.stop_token_ids or []) + ([] if params.ignore_eos else list(eos_token_ids))
        stops = [t for t in stops if 0 <= t < vocab_size]
        stop_ids = torch.tensor(sorted(set(stops)), dtype=torch.long) if stops else None
    return LogitsControls(float(params.presence_penalty), float(params.frequency_penalty),
                          float(params.repetition_penalty), bias_ids, bias_values, allowed, banned, sequences,
                          int(params.min_tokens), stop_ids)


def tokenize_bad_words(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as it would start the text and, when that
    gives a different first token of the same length, after a space (as mid-text)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


class TokenCounts:
    """Per sample with penalties: output-token counts ``[rows, vocab]`` and prompt-token sets, on ``device``.

    Rows are handed out at admission and returned when the sample finishes; the tables grow by
    doubling (a step only ever indexes them).
    """

    def __init__(self, vocab_size: int, capacity: int = 8, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=self.device)
        self.free = list(range(capacity - 1, -1, -1))

    def acquire(self, prompt_token_ids: Sequence[int]) -> int:
        """A zeroed row for a new sample of a prompt; returns its index."""
        if not self.free:
            old = self.counts.shape[0]
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.free = list(range(2 * old - 1, old - 1, -1))
        slot = self.free.pop()
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        self.in_prompt[slot, torch.tensor(prompt_token_ids, dtype=torch.long).to(self.device)] = True
        return slot

    def release(self, slot: int) -> None:
        """Give a row back."""
        self.free.append(slot)

    def record(self, slots: list[int], tokens: list[int]) -> None:
        """Count one sampled token per listed row."""
        if slots:
            self.record_on_device(torch.tensor(slots).to(self.device), torch.tensor(tokens).to(self.device))

    def record_on_device(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per row of ``slots`` (device tensors of the same length)."""
        if slots.numel():
            self.counts.index_put_((slots, tokens), self.counts.new_ones(()).expand(slots.shape[0]), accumulate=True)


@dataclass(slots=True)
class ControlledRow:
    """What :func:`apply_controls` needs of one row: its controls, penalty row and tokens so far."""

    controls: LogitsControls
    slot: int  # TokenCounts row (-1: no penalties)
    token_ids: Sequence[int]  # prompt, then the tokens generated so far
    num_prompt: int

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt


def apply_controls(x: torch.Tensor, rows: Sequence[ControlledRow], counts: TokenCounts | None,
                   dense: bool = False) -> None:
    """Apply every row's controls to ``x`` ``[len(rows), vocab]`` (float32, on any device) in place.

    vLLM's order: allowed ids, bad words, logit bias, min_tokens, then the penalties. Each is one
    batched operation over the rows that use it; per row only its precomputed ids are listed.
    ``dense`` computes the penalties over whole rows (on a GPU; no host read of which tokens
    were seen) instead of gathering the seen tokens (on CPU, where dense rows cost milliseconds).
    """
    dev = x.device
    allowed = [(j, r.controls.allowed) for j, r in enumerate(rows) if r.controls.allowed is not None]
    if allowed:
        keep = torch.zeros((len(allowed), x.shape[1]), dtype=torch.bool, device=dev)
        keep[_row_ids(range(len(allowed)), [a for _, a in allowed]).to(dev, non_blocking=True),
             torch.cat([a for _, a in allowed]).to(dev, non_blocking=True)] = True
        which = torch.tensor([j for j, _ in allowed]).to(dev, non_blocking=True)
        x[which] = x[which].masked_fill(~keep, _NEG_INF)
    bans: list[tuple[int, torch.Tensor]] = []
    late: list[tuple[int, torch.Tensor]] = []  # min_tokens: after the bias, as in vLLM
    for j, r in enumerate(rows):
        c = r.controls
        if c.banned is not None:
            bans.append((j, c.banned))
        if c.bad_sequences:
            hits = [last for prefix, last in c.bad_sequences if _ends_with(r, prefix)]
            if hits:
                bans.append((j, torch.tensor(hits, dtype=torch.long)))
        if c.stop_ids is not None and r.num_output < c.min_tokens:
            late.append((j, c.stop_ids))
    _fill(x, bans, _NEG_INF)
    biased = [(j, r.controls) for j, r in enumerate(rows) if r.controls.bias_ids is not None]
    if biased:
        x.index_put_((_row_ids([j for j, _ in biased], [c.bias_ids for _, c in biased]).to(dev, non_blocking=True),
                      torch.cat([c.bias_ids for _, c in biased]).to(dev, non_blocking=True)),
                     torch.cat([c.bias_values for _, c in biased]).to(dev, non_blocking=True), accumulate=True)
    _fill(x, late, _NEG_INF)
    penalized = [j for j, r in enumerate(rows) if r.slot >= 0]
    if penalized and counts is not None:
        (_penalize_dense if dense else _penalize)(x, penalized, [rows[j] for j in penalized], counts)


def _row_ids(rows: Sequence[int], ids: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each row index repeated once per id of its tensor (the row half of an ``index_put_``)."""
    return torch.tensor(list(rows)).repeat_interleave(torch.tensor([len(t) for t in ids]))


def _fill(x: torch.Tensor, entries: list[tuple[int, torch.Tensor]], value: float) -> None:
    """Set ``x[row, ids] = value`` for every ``(row, ids)`` in one ``index_put_``."""
    if entries:
        x.index_put_((_row_ids([j for j, _ in entries], [t for _, t in entries]).to(x.device),
                      torch.cat([t for _, t in entries]).to(x.device)), x.new_full((), value))


def _penalize(x: torch.Tensor, js: list[int], rows: list[ControlledRow], counts: TokenCounts) -> None:
    """vLLM's penalties on rows ``js`` of ``x``: repetition (prompt + output), then frequency and presence.

    Only the (row, token) pairs a penalty touches are gathered, changed and written back: the
    tokens seen are few next to the vocabulary, and dense broadcast arithmetic over ``[rows, vocab]``
    costs milliseconds a step on CPU.
    """
    which = torch.tensor(js)
    slots = torch.tensor([r.slot for r in rows])
    n = counts.counts[slots]
    reps = [r.controls.repetition for r in rows]
    freq = [r.controls.frequency for r in rows]
    pres = [r.controls.presence for r in rows]
    repeat = any(p != 1.0 for p in reps)
    touched = n > 0
    if repeat:
        touched |= counts.in_prompt[slots]
    r_idx, t_idx = touched.nonzero(as_tuple=True)
    rows_x = which[r_idx]
    vals = x[rows_x, t_idx]
    if repeat:
        rep = torch.tensor(reps, dtype=torch.float32)[r_idx]
        vals = torch.where(vals > 0, vals / rep, vals * rep)
    if any(freq) or any(pres):  # zero for tokens only in the prompt
        c = n[r_idx, t_idx].float()
        vals = vals - torch.tensor(freq, dtype=torch.float32)[r_idx] * c
        vals = vals - torch.tensor(pres, dtype=torch.float32)[r_idx] * (c > 0)
    x[rows_x, t_idx] = vals


def _penalize_dense(x: torch.Tensor, js: list[int], rows: list[ControlledRow], counts: TokenCounts) -> None:
    """:func:`_penalize` over whole rows: the same arithmetic on every token, no host read."""
    dev = x.device
    which = torch.tensor(js).to(dev, non_blocking=True)
    slots = torch.tensor([r.slot for r in rows]).to(dev, non_blocking=True)
    n = counts.counts[slots]
    vals = x[which]
    reps = [r.controls.repetition for r in rows]
    if any(p != 1.0 for p in reps):
        rep = torch.tensor(reps, dtype=torch.float32).to(dev, non_blocking=True)[:, None]
        seen = (n > 0) | counts.in_prompt[slots]
        vals = torch.where(seen, torch.where(vals > 0, vals / rep, vals * rep), vals)
    freq = [r.controls.frequency for r in rows]
    pres = [r.controls.presence for r in rows]
    if any(freq) or any(pres):
        c = n.float()
        vals = vals - torch.tensor(freq, dtype=torch.float32).to(dev, non_blocking=True)[:, None] * c
        vals = vals - torch.tensor(pres, dtype=torch.float32).to(dev, non_blocking=True)[:, None] * (c > 0)
    x[which] = vals


def _ends_with(row: ControlledRow, prefix: tuple[int, ...]) -> bool:
    """True when the row's generated tokens end with ``prefix`` (vLLM matches output only)."""
    k, tokens = len(prefix), row.token_ids
    return row.num_output >= k and tuple(tokens[len(tokens) - k:]) == prefix
