"""Token sampling with per-request parameters and per-request random generators."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapllm.engine.logits_processors import ControlledRow, TokenCounts, apply_controls
from tapllm.engine.request import Request
from tapllm.outputs import Logprob
from tapllm.structured.masks import TokenMask


@dataclass(slots=True)
class RowFailure:
    """Why one request's row could not be sampled (the others in the step are unaffected)."""

    message: str
    error_type: str  # "invalid_request_error" (its own input caused it) | "server_error"


def sample(logits: torch.Tensor, requests: list[Request], counts: TokenCounts | None = None,
           token_mask: TokenMask | None = None) -> tuple[list[int], dict[int, RowFailure]]:
    """Pick one token per row of ``logits`` [N, vocab] (model dtype) for ``requests``.

    ``token_mask`` (structured output) first limits its rows to the tokens their grammars allow.
    Rows of requests with logits controls (penalties, bias, bans, allowed ids, min_tokens) are
    gathered and processed together next (see ``logits_processors``); other rows are read as
    they are. Greedy rows take the argmax. Sampled rows draw from their own generator, so a
    seeded request gets the same tokens whatever else is in the batch. Logprobs, when asked,
    are recorded on the request from the distribution before the controls, temperature and
    top-k/p (after the grammar mask), as vLLM reports them.

    A row whose logits are not finite (e.g. a steer too strong for the dtype), whose controls
    leave no token to sample, or whose draw fails, is returned in the failures by row index;
    every other row is sampled as usual.
    """
    # float32 holds every lower-precision logit exactly, and on CPU argmax and the reductions
    # run several times faster in it than in bf16, cast included. amax/amin propagate NaN.
    values = logits.float()
    controlled = [row for row, req in enumerate(requests) if req.controls is not None]
    processed: dict[int, torch.Tensor] = {}
    # As in vLLM, the grammar mask applies before everything, the logprobs included.
    picks = values if token_mask is None else token_mask.apply(values)
    failures: dict[int, RowFailure] = {}
    for row, message in (token_mask.errors if token_mask is not None else {}).items():
        failures[row] = RowFailure(message, "server_error")
    finite = torch.isfinite(values.amax(dim=-1)) & torch.isfinite(values.amin(dim=-1))
    if not bool(finite.all()):
        for row in (~finite).nonzero().flatten().tolist():
            req = requests[row]
            cause = "invalid_request_error" if req.steering else "server_error"
            hint = " (its steering is too strong for this dtype)" if req.steering else ""
            failures[row] = RowFailure(f"the model produced non-finite logits for this request{hint}", cause)
    # Rows with controls take their argmax after processing: skip the raw one when that is every row.
    tokens = picks.argmax(dim=-1) if len(controlled) < len(requests) else torch.zeros(len(requests), dtype=torch.long)
    if controlled:
        controlled = [row for row in controlled if row not in failures]
        rows, x = _controlled(picks, controlled, requests, counts, failures)
        if rows:
            tokens[torch.tensor(rows)] = x.argmax(dim=-1)
            processed = dict(zip(rows, x.unbind(0)))
    tokens = tokens.tolist()
    for row, req in enumerate(requests):
        p = req.params
        if row in failures or (p.greedy and p.logprobs is None and not req.track_cumulative):
            continue
        try:
            if not p.greedy:
                tokens[row] = _draw(processed.get(row, picks[row]), req)
            if p.logprobs is not None:
                _record_logprobs(picks[row], tokens[row], req)
            elif req.track_cumulative:
                req.cumulative_logprob += float(picks[row].log_softmax(-1)[tokens[row]])
        except Exception as exc:  # noqa: BLE001 - belongs to this row alone
            failures[row] = RowFailure(f"sampling failed: {type(exc).__name__}: {exc}", "server_error")
    if counts is not None and controlled:
        done = [row for row in controlled if row not in failures and requests[row].counts_slot >= 0]
        counts.record([requests[row].counts_slot for row in done], [tokens[row] for row in done])
    return tokens, failures


def _controlled(values: torch.Tensor, rows: list[int], requests: list[Request], counts: TokenCounts | None,
                failures: dict[int, RowFailure]) -> tuple[list[int], torch.Tensor]:
    """The controlled ``rows`` that can be sampled and their processed logits ``[len, vocab]``.

    All rows are processed in one batch; should that raise, each row is retried alone so the
    failure stays with the row that caused it. A row left with no token to sample fails alone.
    """
    specs = [ControlledRow(requests[r].controls, requests[r].counts_slot, requests[r].token_ids,
                           requests[r].num_prompt_tokens) for r in rows]
    try:
        x = values[torch.tensor(rows)]
        apply_controls(x, specs, counts)
    except Exception:  # noqa: BLE001 - isolated row by row below
        kept, parts = [], []
        for row, spec in zip(rows, specs):
            try:
                part = values[row : row + 1].clone()
                apply_controls(part, [spec], counts)
                kept.append(row)
                parts.append(part)
            except Exception as exc:  # noqa: BLE001 - belongs to this row alone
                failures[row] = RowFailure(f"logits processing failed: {type(exc).__name__}: {exc}", "server_error")
        rows = kept
        x = torch.cat(parts) if parts else values[:0]
    ok = torch.isfinite(x.amax(dim=-1))
    if not bool(ok.all()):
        for j in (~ok).nonzero().flatten().tolist():
            failures[rows[j]] = RowFailure(
                "no token can be sampled: allowed_token_ids, bad_words and min_tokens together exclude every "
                "token (or a bias or penalty made the logits non-finite)", "invalid_request_error")
        rows = [r for r, good in zip(rows, ok.tolist()) if good]
        x = x[ok]
    return rows, x


_TOP_P_HEAD = 256  # tokens ordered first for top-p (see _draw)


def _draw(row: torch.Tensor, req: Request) -> int:
    p = req.params
    x = row / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if p.top_p < 1.0:
        # Drop a token once the mass before it already reaches top_p; the most likely one
        # always stays, so a tiny top_p means greedy rather than an empty distribution. The
        # cut usually falls among the few most likely tokens: when the top 256 hold top_p,
        # every token after them is dropped and only they need ordering, far cheaper than
        # sorting the whole vocabulary; otherwise the whole row is sorted.
        head = min(_TOP_P_HEAD, probs.numel())
        top, order = torch.topk(probs, head)
        if head < probs.numel() and float(top.sum()) < p.top_p:
            top, order = torch.sort(probs, descending=True)
        keep = order[(top.cumsum(-1) - top) < p.top_p]
        if keep.numel() == 0:
            keep = order[:1]
        probs = torch.zeros_like(probs).index_copy_(0, keep, probs[keep])
        probs /= probs.sum()
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    # Inverse CDF with one uniform from the request's generator: exact sampling, and several
    # times cheaper than torch.multinomial over a whole vocabulary on CPU. Float64 sums keep the
    # tail's mass; a zero-probability token is never picked (the first cdf > u has mass).
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, dtype=torch.float64, generator=req.generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1))


def _record_logprobs(row: torch.Tensor, token: int, req: Request) -> None:
    lp = row.log_softmax(-1)
    chosen = float(lp[token])
    entry = {token: Logprob(chosen, int((lp > lp[token]).sum()) + 1)}
    k = min(req.params.logprobs or 0, lp.numel())
    if k:
        vals, ids = torch.topk(lp, k)
        for rank, (v, i) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            entry.setdefault(i, Logprob(v, rank))
    req.logprobs.append(entry)
    req.cumulative_logprob += chosen
