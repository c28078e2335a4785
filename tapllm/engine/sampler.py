"""Token sampling with per-request parameters and per-request random generators."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapllm.engine.request import Request
from tapllm.outputs import Logprob
from tapllm.structured.masks import TokenMask


@dataclass(slots=True)
class RowFailure:
    """Why one request's row could not be sampled (the others in the step are unaffected)."""

    message: str
    error_type: str  # "invalid_request_error" (its own input caused it) | "server_error"


def sample(logits: torch.Tensor, requests: list[Request],
           token_mask: TokenMask | None = None) -> tuple[list[int], dict[int, RowFailure]]:
    """Pick one token per row of ``logits`` [N, vocab] (model dtype) for ``requests``.

    ``token_mask`` (structured output) limits its rows to the tokens their grammars allow.

    Greedy rows take the argmax. Sampled rows draw from their own generator, so a seeded
    request gets the same tokens whatever else is in the batch. Logprobs, when asked, are
    recorded on the request (from the distribution before temperature and top-k/p, as vLLM reports them).

    A row whose logits are not finite (e.g. a steer too strong for the dtype), or whose draw
    fails, is returned in the failures by row index; every other row is sampled as usual.
    """
    # float32 holds every lower-precision logit exactly, and on CPU argmax and the reductions
    # run several times faster in it (batch 64 x 49,152 bf16: 6.1 ms for argmax, 4.0 ms for
    # isfinite().all(); after the 0.14 ms cast, 1.5 and 0.15 ms). amax/amin propagate NaN.
    values = logits.float()
    # As in vLLM, the grammar mask applies before everything, the logprobs included.
    picks = values if token_mask is None else token_mask.apply(values)
    tokens = picks.argmax(dim=-1).tolist()
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
    for row, req in enumerate(requests):
        p = req.params
        if row in failures or (p.greedy and p.logprobs is None):
            continue
        try:
            if not p.greedy:
                tokens[row] = _draw(picks[row], req)
            if p.logprobs is not None:
                _record_logprobs(picks[row], tokens[row], req)
        except Exception as exc:  # noqa: BLE001 - belongs to this row alone
            failures[row] = RowFailure(f"sampling failed: {type(exc).__name__}: {exc}", "server_error")
    return tokens, failures


def _draw(row: torch.Tensor, req: Request) -> int:
    p = req.params
    x = row / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token once the mass before it already reaches top_p; the most likely one
        # always stays, so a tiny top_p means greedy rather than an empty distribution.
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop[0] = False
        x = x.scatter(0, order[drop], float("-inf"))
    probs = x.softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=req.generator).item())


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
