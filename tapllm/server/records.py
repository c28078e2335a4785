"""What the latency metrics need of a finished request, as a small value that can cross a process boundary.

The in-process engine thread builds it from the ``Request``; the engine-core process builds it
there and sends it with the request's last update (``tapllm.server.ipc``). ``time.monotonic()``
is the system's monotonic clock on Linux, so times taken in the core compare with the server's.
"""

from __future__ import annotations

import msgspec

from tapllm.engine.request import Request


class FinishedRecord(msgspec.Struct, frozen=True):
    """A completed request's stage times and sizes (see ``RequestTimes`` for what each time means)."""

    arrival: float | None
    queued: float | None
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float | None
    encode_only: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    generated: int  # tokens of the first sample (0 for an encode request)
    max_generated: int  # most tokens of any sample
    finish_reason: str | None
    num_preemptions: int  # of the first sample
    group_preemptions: int  # of all samples
    n: int
    max_tokens: int


def record_of(request: Request) -> FinishedRecord:
    """The record of a request that has finished."""
    t, group = request.times, request.group
    return FinishedRecord(
        t.arrival, t.queued, t.scheduled, t.first_token, t.last_token, t.finished, request.encode_only,
        request.num_prompt_tokens, request.num_cached_tokens,
        0 if request.encode_only else len(request.output_token_ids),
        max(len(s.output_token_ids) for s in group), request.finish_reason, request.num_preemptions,
        sum(s.num_preemptions for s in group), request.params.n, request.max_tokens,
    )
