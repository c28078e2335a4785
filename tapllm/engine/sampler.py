"""Token sampling on the device, with per-request parameters and per-request seeded draws.

A step's sampling is planned on the host before its forward pass (:class:`SamplingPlan`):
which rows draw and with what temperature, top-k, top-p and min-p, which rows have logits
controls or want logprobs, and one uniform per drawing row from its request's seed and the index
of the token it samples (:mod:`tapllm.engine.rng`: so a seeded request gets the same tokens
whatever else shares its batch, and the same tokens from a CUDA graph's sampler). The
plan's numbers travel in the step's one upload (:mod:`tapllm.engine.staging`). On the device,
:meth:`SamplingPlan.sample` turns the logits into one float64 vector of results (the tokens,
then the logprobs asked for), which the step copies back in its one download and
:meth:`SamplingPlan.read` turns into tokens, logprobs and per-row failures. Nothing in
between reads a device value on the host.

Greedy rows take the argmax. Drawing rows divide by their temperature, keep their top-k,
their top-p nucleus (the most likely token always stays) and tokens with at least min-p times
the top probability, then pick by inverse CDF with their uniform (float64 sums keep the
tail's mass; a zero-probability token is never picked). Every cut is by value, so tokens tied
with the last one kept are kept too: the result does not depend on how a sort orders ties.
Logprobs are taken from the distribution before the controls, temperature and top-k/p (after
the grammar mask), as vLLM reports them. A row whose logits are not finite (e.g. a steer too strong for the dtype), or
whose controls leave no token, fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tapllm.engine.logits_processors import ControlledRow, TokenCounts, apply_controls
from tapllm.engine.request import Request
from tapllm.engine.rng import as_int64, uniform_host
from tapllm.engine.staging import Staging
from tapllm.outputs import Logprob
from tapllm.structured.masks import TokenMask

NONFINITE, NO_TOKEN = -1, -2  # failure codes in the token slot of a row's result
_TOP_P_HEAD = 256  # on CPU, tokens ordered first for top-p (the whole row only when they hold too little)


@dataclass(slots=True)
class RowFailure:
    """Why one request's row could not be sampled (the others in the step are unaffected)."""

    message: str
    error_type: str  # "invalid_request_error" (its own input caused it) | "server_error"


class SamplingPlan:
    """One step's sampling: planned on the host, run on the device, read back on the host."""

    def __init__(self, requests: list[Request], vocab_size: int, staging: Staging, device: torch.device,
                 canonical_ties: bool = False) -> None:
        self.requests = requests
        self.vocab = vocab_size
        self.device = device
        # batch_invariant: top logprobs tied in value in id order, not in whatever order topk over the
        # step's largest k leaves them (a request's k-th entry would depend on its neighbours' k)
        self.canonical_ties = canonical_ties
        n = len(requests)
        params = [r.params for r in requests]
        self.draw = [j for j, p in enumerate(params) if not p.greedy]
        self.controlled = [j for j, r in enumerate(requests) if r.controls is not None]
        self.penalized = [j for j in self.controlled if requests[j].counts_slot >= 0]
        self.logprob_rows = [j for j, r in enumerate(requests) if r.params.logprobs is not None or r.track_cumulative]
        self.logprob_k = [0 if requests[j].params.logprobs is None else min(requests[j].params.logprobs, vocab_size)
                          for j in self.logprob_rows]
        self.max_k = max(self.logprob_k, default=0)
        self._sections: dict[str, int] = {}
        if self.draw:
            drawn = [params[j] for j in self.draw]
            top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in drawn]
            self.top_k_max = max(top_k)
            self.nucleus = [i for i, p in enumerate(drawn) if np.float32(p.top_p) < 1]  # as the device sees it
            self.min_p = any(p.min_p > 0 for p in drawn)
            self._add(staging, "draw", self.draw, torch.int64)
            self._add(staging, "temperature", [p.temperature for p in drawn], torch.float32)
            self._add(staging, "min_p", [p.min_p for p in drawn], torch.float32)
            if self.top_k_max:
                self._add(staging, "top_k", top_k, torch.int64)
            if self.nucleus:
                self._add(staging, "nucleus", self.nucleus, torch.int64)
                self._add(staging, "top_p", [drawn[i].top_p for i in self.nucleus], torch.float32)
            self._sections["uniform"], uniforms = staging.zeros(len(self.draw), torch.float64)
            uniforms[:] = uniform_host(_seeds([requests[j] for j in self.draw]),
                                       np.array([requests[j].num_tokens for j in self.draw], dtype=np.int64))
        if self.controlled:
            self._add(staging, "controlled", self.controlled, torch.int64)
        if self.penalized:
            self._add(staging, "penalized", [self.controlled.index(j) for j in self.penalized], torch.int64)
            self._add(staging, "count_slots", [requests[j].counts_slot for j in self.penalized], torch.int64)
        if self.logprob_rows:
            self._add(staging, "logprob_rows", self.logprob_rows, torch.int64)
        self.rows = n
        self.views: dict[str, torch.Tensor] = {}

    def _add(self, staging: Staging, name: str, values: list, dtype: torch.dtype) -> None:
        self._sections[name] = staging.add(values, dtype)

    def bind(self, uploaded: list[torch.Tensor]) -> None:
        """Take the device views of the plan's sections after the step's upload."""
        self.views = {name: uploaded[i] for name, i in self._sections.items()}

    # ---- on the device -----------------------------------------------------------------
    def sample(self, logits: torch.Tensor, counts: TokenCounts | None, token_mask: TokenMask | None) -> torch.Tensor:
        """The step's results as one float64 vector: a token (or failure code) per row, then per
        logprob row its chosen logprob, its rank, and its top-k logprobs and ids."""
        v = self.views
        values = logits.float()
        picks = values if token_mask is None else token_mask.apply(values)
        processed = picks
        if self.controlled:
            idx = v["controlled"]
            x = picks.index_select(0, idx)
            specs = [ControlledRow(r.controls, r.counts_slot, r.token_ids, r.num_prompt_tokens)
                     for r in (self.requests[j] for j in self.controlled)]
            apply_controls(x, specs, counts, dense=self.device.type != "cpu")
            processed = picks.index_copy(0, idx, x)
            has_token = torch.isfinite(x.amax(dim=-1))
            ok_codes = torch.zeros(self.rows, dtype=torch.bool, device=values.device).index_copy_(0, idx, ~has_token)
        else:
            ok_codes = None
        # max's indices are argmax's (the first maximal one, NaN counting as maximal) in one pass over the
        # row where CPU argmax takes 2.5x as long; its values stand for values.amax when nothing was masked
        top, tokens = processed.max(dim=-1)
        if processed is not values:
            top = values.amax(dim=-1)
        ok = torch.isfinite(top) & torch.isfinite(values.amin(dim=-1))
        if self.draw:
            tokens = tokens.index_copy(0, v["draw"], self._draw(processed.index_select(0, v["draw"])))
        tokens = tokens.double()
        if ok_codes is not None:
            tokens = tokens.masked_fill(ok_codes, NO_TOKEN)
        tokens = tokens.masked_fill(~ok, NONFINITE)
        if self.penalized and counts is not None:
            chosen = tokens.index_select(0, v["controlled"]).index_select(0, v["penalized"]).clamp(min=0).long()
            counts.record_on_device(v["count_slots"], chosen)
        if not self.logprob_rows:
            return tokens
        return torch.cat([tokens, self._logprobs(picks, tokens).reshape(-1)])

    def _draw(self, x: torch.Tensor) -> torch.Tensor:
        """One token per drawing row of ``x`` [m, vocab] (float32, after controls)."""
        v = self.views
        x = x / v["temperature"][:, None]
        if self.top_k_max:
            k = v["top_k"]
            kth = torch.topk(x, self.top_k_max, dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
            x = x.masked_fill((k[:, None] > 0) & (x < kth), float("-inf"))
        probs = x.softmax(dim=-1)
        if self.nucleus:
            rows = v["nucleus"]
            probs = probs.index_copy(0, rows, _nucleus(probs.index_select(0, rows), v["top_p"]))
        if self.min_p:
            probs = probs.masked_fill(probs < v["min_p"][:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        cdf = probs.double().cumsum(dim=-1)
        u = v["uniform"][:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).clamp_(max=x.shape[-1] - 1).squeeze(1)

    def _logprobs(self, picks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Per logprob row ``[chosen, rank, top-k logprobs..., top-k ids...]`` (float64)."""
        rows = self.views["logprob_rows"]
        lp = picks.index_select(0, rows).log_softmax(dim=-1)
        chosen_ids = tokens.index_select(0, rows).clamp(min=0).long()
        chosen = lp.gather(1, chosen_ids[:, None])
        rank = (lp > chosen).sum(dim=-1, keepdim=True) + 1
        parts = [chosen.double(), rank.double()]
        if self.max_k:
            vals, ids = (top_in_id_order if self.canonical_ties else torch.topk)(lp, self.max_k, dim=-1)
            parts += [vals.double(), ids.double()]
        return torch.cat(parts, dim=1)

    # ---- back on the host -----------------------------------------------------------------
    def read(self, results: np.ndarray, failures: dict[int, RowFailure]) -> list[int]:
        """Tokens per row from the downloaded ``results``; failed rows go to ``failures`` (by row)."""
        n = self.rows
        tokens = read_tokens(results[:n], self.requests, failures)
        if self.logprob_rows:
            width = 2 + 2 * self.max_k
            block = results[n:].reshape(len(self.logprob_rows), width)
            for i, row in enumerate(self.logprob_rows):
                if row in failures:
                    continue
                req, k = self.requests[row], self.logprob_k[i]
                chosen, rank = float(block[i, 0]), int(block[i, 1])
                if req.params.logprobs is None:  # track_cumulative alone
                    req.cumulative_logprob += chosen
                    continue
                entry = {tokens[row]: Logprob(chosen, rank)}
                top_vals = block[i, 2:2 + k].tolist()
                top_ids = block[i, 2 + self.max_k:2 + self.max_k + k].astype(np.int64).tolist()
                for r, (value, tid) in enumerate(zip(top_vals, top_ids), start=1):
                    entry.setdefault(tid, Logprob(value, r))
                req.logprobs.append(entry)
                req.cumulative_logprob += chosen
        return tokens


def _seeds(requests: list[Request]) -> np.ndarray:
    """The drawing requests' seeds as int64 (each is given one at admission)."""
    missing = [r.request_id for r in requests if r.seed is None]
    if missing:
        raise ValueError(f"requests {missing} sample at random but have no seed (LLMEngine.add gives each one)")
    return np.array([as_int64(r.seed) for r in requests], dtype=np.int64)


def read_tokens(results: np.ndarray, requests: list[Request], failures: dict[int, RowFailure]) -> list[int]:
    """Tokens per row from a sampler's downloaded codes (one per row of ``requests``); a row whose code
    says it failed goes to ``failures`` (by row) with why."""
    tokens = results.astype(np.int64).tolist()
    for row, token in enumerate(tokens):
        if row in failures or token >= 0:
            continue
        req = requests[row]
        if token == NONFINITE:
            cause = "invalid_request_error" if req.steering else "server_error"
            hint = " (its steering is too strong for this dtype)" if req.steering else ""
            failures[row] = RowFailure(f"the model produced non-finite logits for this request{hint}", cause)
        else:
            failures[row] = RowFailure(
                "no token can be sampled: allowed_token_ids, bad_words and min_tokens together exclude every "
                "token (or a bias or penalty made the logits non-finite)", "invalid_request_error")
    return tokens


def graph_samples(req: Request) -> bool:
    """Whether a request's row can be sampled by the graph's sampler (``engine/graph_sampler.py``): no
    logprobs, logits controls or grammar (those stay with :class:`SamplingPlan`)."""
    return req.params.logprobs is None and not req.track_cumulative and req.controls is None and req.grammar is None


def top_in_id_order(lp: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(lp, k)`` of rows ``[m, vocab]`` with ties ordered by token id: the k largest in the
    order (value descending, id ascending), so the first j of them are the top j for any j <= k.
    Sizes its result from a device value (``nonzero``: a sync on a GPU); logprobs are sampled outside
    CUDA graphs, so no graph holds it."""
    assert dim in (-1, lp.dim() - 1)
    kth = torch.topk(lp, k, dim=-1).values[:, -1:]
    above, tied = lp > kth, lp == kth
    chosen = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    ids = chosen.nonzero()[:, 1].view(lp.shape[0], k)  # k per row, in id order
    vals = lp.gather(1, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``probs`` [m, vocab] cut to each row's top-p nucleus and renormalised.

    In the row sorted by probability, a position is kept while the mass before it is below
    top_p (the first always is); every token at least as likely as the least likely kept one
    stays, so tied tokens stay or go together. On CUDA every row is sorted (no host read). On
    CPU the cut usually falls among the few most likely tokens: when the top 256 of every row
    hold its top_p, only they are ordered (a host read of a host tensor, not a device sync),
    else the rows are sorted whole; both give the same tokens (the head's running sums are the
    sorted row's, and past them nothing is kept).
    """
    head = min(_TOP_P_HEAD, probs.shape[-1])
    if probs.device.type == "cpu" and head < probs.shape[-1]:
        top = torch.topk(probs, head, dim=-1).values
        mass = top.cumsum(dim=-1)
        if bool((mass[:, -1] >= top_p).all()):
            return keep_nucleus(probs, top, mass, top_p)
    top = torch.sort(probs, dim=-1, descending=True).values
    return keep_nucleus(probs, top, top.cumsum(dim=-1), top_p)


def keep_nucleus(probs: torch.Tensor, top: torch.Tensor, mass: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``probs`` [m, vocab] with every token below each row's nucleus floor zeroed, renormalised.

    ``top`` is the row's probabilities in descending order (all of them, or a head that holds
    top_p) and ``mass`` their running sums: a position is kept while the mass before it is
    below ``top_p``, and the floor is the least kept probability (by value: ties at the cut are kept).
    """
    before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=1)
    kept = before < top_p[:, None]
    floor = top.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)
    out = probs.masked_fill(probs < floor, 0.0)
    return out / out.sum(dim=-1, keepdim=True)
