"""What a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """The log probability of one token, its rank among all tokens, and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "error" (see RequestOutput.error)
    stop_reason: int | str | None = None  # the stop token id or stop string that matched (None at EOS, as vLLM)
    hidden_states: Any = None  # this completion's states (prompt positions included), when asked


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt, its completion(s) and, when asked, its hidden states.

    ``outputs`` holds ``n`` completions; ``hidden_states`` is ``outputs[0].hidden_states`` (the
    prompt's alone for an encode request).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    hidden_states: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's form: None first
    # Set when this request alone failed while others in its batch went on: the message, and
    # "invalid_request_error" (its own input caused it) or "server_error" (e.g. a plugin raised).
    error: str | None = None
    error_type: str | None = None
