"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from tapllm.engine.logits_processors import LogitsControls
from tapllm.engine.prompt_logprobs import PromptLogprobs
from tapllm.engine.tokenizer import IncrementalDetokenizer
from tapllm.hidden_states.capture import RequestCapture
from tapllm.hidden_states.resolved import Selection
from tapllm.hidden_states.result import HiddenStates
from tapllm.outputs import Logprob
from tapllm.sampling_params import SamplingParams
from tapllm.steering.resolved import RequestSteering
from tapllm.structured.compiler import GrammarMatcher


@dataclass(slots=True)
class RequestTimes:
    """When a request reached each stage, in ``time.monotonic()`` seconds (``None``: not yet).

    ``arrival`` is when its caller received it (the server sets it when the HTTP request came
    in; otherwise when the engine took it); ``queued`` when the engine took it; ``scheduled``
    when it first ran; ``first_token``/``last_token`` when a step sampled its first/latest token.
    """

    arrival: float | None = None
    queued: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    def on_token(self, now: float) -> None:
        """A step sampled a token for the request at ``now``."""
        if self.first_token is None:
            self.first_token = now
        self.last_token = now


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PositionFeature(Protocol):
    """What the engine asks of a feature that reads a request's positions as they run (hidden-state
    capture, prompt logprobs): where it still needs the request run, and what a chunk gives it."""

    def first_needed(self, num_tokens: int) -> int:
        """The first position it still needs run (``num_tokens`` or more: none)."""

    def window(self, start: int, num_tokens: int) -> tuple[int, int] | None:
        """The positions ``[a, b)`` it takes from a chunk running ``[start, start + num_tokens)``."""


@dataclass(slots=True, eq=False)
class Request:
    """Tokens, cache blocks, sampling state and output of one request.

    ``token_ids`` holds the prompt followed by the generated tokens; the first
    ``num_computed_tokens`` of them have their K/V in the blocks of ``block_table``.
    """

    request_id: str
    arrival: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None  # what its random draws come from (tapllm.engine.rng); None: it never draws
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: bytes = b""  # enters every block's hash: no sharing with other salts
    depth: int | None = None  # prompt-only: blocks its forward needs (None: all; KV of the rest not written)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_pending: int = 0  # tokens sampled on the device whose value the host has not taken yet (a step ahead)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    detokenizer: IncrementalDetokenizer | None = None
    selection: Selection | None = None  # the resolved hidden-state spec (see EngineCoreRequest)
    capture: RequestCapture | None = None
    prompt_lp: PromptLogprobs | None = None  # prompt logprobs being gathered (params.prompt_logprobs)
    prompt_logprobs: list | None = None  # their result, made when the request finishes
    hidden_states: HiddenStates | None = None  # the result, made when the request finishes
    steering: RequestSteering | None = None  # its resolved steers (see block_salt)
    encode_only: bool = False  # run the prompt for its hidden states; sample nothing
    max_tokens: int = 1  # params.max_tokens, or the rest of the context when that is None
    error: str | None = None  # why this request alone failed (finish_reason "error")
    error_type: str | None = None  # "invalid_request_error" | "server_error"
    times: RequestTimes = field(default_factory=RequestTimes)  # stage timestamps, for latency metrics
    controls: LogitsControls | None = None  # logits controls, resolved (see EngineCoreRequest)
    counts_slot: int = -1  # its row in the runner's TokenCounts (penalties only)
    track_cumulative: bool = False  # sum chosen-token logprobs even without logprobs (best_of > n)
    # Parallel samples (n / best_of > 1): sample 0 is the request itself and runs the prompt; the
    # others wait in ``forks`` until the prompt is computed, then share its blocks (``parent``).
    sample_index: int = 0
    parent: Request | None = None
    samples: list[Request] = field(default_factory=list)  # on sample 0: samples 1.. (forked or not)
    forks: list[Request] = field(default_factory=list)  # on sample 0: samples not forked yet
    grammar: GrammarMatcher | None = None  # where its output is in its structured-output grammar

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    def block_salt(self, index: int, block_size: int) -> bytes:
        """What besides the tokens the KV of block ``index`` depends on (its prefix-cache salt)."""
        if self.steering is None:
            return self.cache_salt
        return self.cache_salt + self.steering.block_salt(index, block_size)

    def first_needed(self) -> int:
        """The first position this request must run itself, not read from the prefix cache.

        Positions it still has to capture or to compute prompt logprobs for are recomputed;
        the rest of its prefix may come from the cache (the last token is always run).
        """
        first = self.num_tokens - 1
        for feature in self.position_features:
            first = min(first, feature.first_needed(self.num_tokens))
        return first

    @property
    def position_features(self) -> list[PositionFeature]:
        """The features that read this request's positions as they run (capture, prompt logprobs)."""
        return [f for f in (self.capture, self.prompt_lp) if f is not None]

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far, those still on their way from the device included."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is RequestStatus.FINISHED

    @property
    def group(self) -> list[Request]:
        """Every sample of this request's prompt, sample 0 first."""
        root = self.parent or self
        return [root, *root.samples]

    @property
    def group_finished(self) -> bool:
        """True once every sample of this request's prompt has finished."""
        root = self.parent or self
        return root.finished and all(s.finished for s in root.samples)
