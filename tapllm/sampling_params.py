"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tapllm._text import check_unicode
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.steering.spec import Steer
from tapllm.structured.params import StructuredOutputsParams

# Below this a temperature means greedy decoding, as in vLLM: dividing logits by it would
# overflow float32 (1e-45 is a valid float but makes every logit infinite).
SAMPLING_EPS = 1e-5
# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completion.

    ``max_tokens=None`` generates up to the end of the context (as in vLLM).
    ``temperature == 0`` (or below 1e-5, as in vLLM) means greedy decoding. ``seed`` (an
    integer in [-2**63, 2**64 - 1]) makes sampling reproducible for this request regardless
    of what else shares its batch. ``top_k`` 0 or -1 disables top-k. ``stop`` strings end generation
    and are not included in the text; ``stop_token_ids`` (and EOS unless ``ignore_eos``)
    end it too. ``logprobs=N`` returns, per generated token, the chosen token's logprob
    plus the top ``N`` alternatives (``0`` returns only the chosen token's); ``prompt_logprobs=N``
    does the same for every prompt token after the first (``RequestOutput.prompt_logprobs``, as
    in vLLM: its first entry is ``None``).
    ``hidden_states`` (a ``HiddenStatesSpec`` or a dict of its fields) asks for activations
    with the text; they arrive in ``RequestOutput.hidden_states``. ``steering`` (a list of
    ``Steer`` or dicts of its fields) adds or ablates directions in this request's residual
    stream, in order; other requests in the batch are untouched.
    ``structured_outputs`` (a ``StructuredOutputsParams`` or a dict of its fields) constrains the
    output to a JSON schema, a regex, a choice or a grammar, as in vLLM.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    hidden_states: HiddenStatesSpec | dict[str, Any] | None = None
    steering: list[Steer | dict[str, Any]] | None = None
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
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
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and its limit if a value is out of range.

        Values are checked as the sampler will use them: as float32 numbers on the device.
        """
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, or None for the rest of the context, "
                             f"got {self.max_tokens!r}")
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1 or np.float32(top_p) == 0:
            raise ValueError(f"top_p must be in (0, 1] and at least {np.finfo(np.float32).smallest_subnormal:.3g} "
                             f"(the smallest float32 above 0), got {top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0, or -1 or 0 to disable it, got {self.top_k!r}")
        min_p = _real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError("stop must hold non-empty strings")
        for s in self._stop:
            check_unicode(s, "stop")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must hold non-negative integers")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0, or below 1e-5 as in vLLM)."""
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple."""
        return self._stop


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _real(name: str, value: Any) -> float:
    """``value`` as a finite float; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return out
