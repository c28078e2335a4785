"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.steering.spec import Steer


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completion.

    ``temperature == 0`` means greedy decoding. ``seed`` makes sampling reproducible for
    this request regardless of what else shares its batch. ``stop`` strings end generation
    and are not included in the text; ``stop_token_ids`` (and EOS unless ``ignore_eos``)
    end it too. ``logprobs=N`` returns, per generated token, the chosen token's logprob
    plus the top ``N`` alternatives (``0`` returns only the chosen token's).
    ``hidden_states`` (a ``HiddenStatesSpec`` or a dict of its fields) asks for activations
    with the text; they arrive in ``RequestOutput.hidden_states``. ``steering`` (a list of
    ``Steer`` or dicts of its fields) adds or ablates directions in this request's residual
    stream, in order; other requests in the batch are untouched.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    hidden_states: HiddenStatesSpec | dict[str, Any] | None = None
    steering: list[Steer | dict[str, Any]] | None = None
    _stop: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.hidden_states is not None:
            self.hidden_states = HiddenStatesSpec.from_any(self.hidden_states)
        if self.steering is not None:
            if isinstance(self.steering, Steer | dict):
                self.steering = [self.steering]
            self.steering = [Steer.from_any(s) for s in self.steering]
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and its limit if a value is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError("stop must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must hold non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0)."""
        return self.temperature == 0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple."""
        return self._stop
