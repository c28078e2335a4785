"""Per-request sampling parameters."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.steering.spec import Steer
from tapllm.structured.params import StructuredOutputsParams
from tapllm.utils.checks import is_int, is_list_of, is_real, kind, real
from tapllm.utils.text import check_unicode

# Below this a temperature means greedy decoding, as in vLLM: dividing logits by it would
# overflow float32 (1e-45 is a valid float but makes every logit infinite).
SAMPLING_EPS = 1e-5
# A seed is read as its low 64 bits (an int64 or a uint64; see tapllm.engine.rng.as_int64).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class RequestOutputKind(enum.IntEnum):
    """vLLM's ``output_kind``: what each streamed ``RequestOutput`` holds. ``LLM.generate`` returns
    finished outputs whatever it is (vLLM's offline API sets ``FINAL_ONLY`` itself)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# vLLM 0.32 SamplingParams fields tapllm does not implement -> the values that ask for nothing.
# Anything else is refused naming the field (see docs/generation.md, "Sampling parameters").
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "watermarking": (None, False),
    "logprob_token_ids": (None,),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None, 0),
    "flat_logprobs": (False,),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "routed_experts_prompt_start": (0,),
    "trace_decode_token_ids": (None,),
}


def _str(x: Any) -> bool:
    return isinstance(x, str)


def _strs(v: Any) -> bool:
    return isinstance(v, str) or is_list_of(v, _str)


def _ints(v: Any) -> bool:
    return is_list_of(v, is_int)


def _steers(v: Any) -> bool:
    return isinstance(v, Steer | dict) or is_list_of(v, lambda x: isinstance(x, Steer | dict))


def _optional(check: Any) -> Any:
    return lambda v: v is None or check(v)


_INT, _REAL, _BOOL = (is_int, "an integer"), (is_real, "a number"), (lambda v: isinstance(v, bool), "true or false")

# Each field's type, checked before anything reads the value, so a wrong one is named (``stop=5``: "stop must
# be a string or a list of strings, got int"); ranges and the items' values are checked in ``validate``.
# vLLM's refused fields (UNSUPPORTED_FIELDS) take any type: only their neutral values pass.
FIELD_TYPES: dict[str, tuple[Any, str]] = {
    "max_tokens": (_optional(is_int), "an integer or None"),
    "temperature": _REAL, "top_p": _REAL, "top_k": _INT, "min_p": _REAL,
    "seed": (_optional(is_int), "an integer or None"),
    "stop": (_optional(_strs), "a string or a list of strings"),
    "stop_token_ids": (_optional(_ints), "a list of integers"),
    "ignore_eos": _BOOL,
    "logprobs": (_optional(is_int), "an integer or None"),
    "prompt_logprobs": (_optional(is_int), "an integer or None"),
    "skip_special_tokens": _BOOL,
    "hidden_states": (_optional(lambda v: isinstance(v, HiddenStatesSpec | dict)), "a HiddenStatesSpec or a dict"),
    "steering": (_optional(_steers), "a Steer, a dict, or a list of them"),
    "n": _INT,
    "best_of": (_optional(is_int), "an integer or None"),
    "presence_penalty": _REAL, "frequency_penalty": _REAL, "repetition_penalty": _REAL,
    "logit_bias": (_optional(lambda v: isinstance(v, dict)), "a dict of token id -> bias"),
    "min_tokens": _INT,
    "bad_words": (_optional(_strs), "a string or a list of strings"),
    "allowed_token_ids": (_optional(_ints), "a list of integers"),
    "truncate_prompt_tokens": (_optional(is_int), "an integer or None"),
    "structured_outputs": (_optional(lambda v: isinstance(v, StructuredOutputsParams | dict)),
                           "a StructuredOutputsParams or a dict"),
    "include_stop_str_in_output": _BOOL, "spaces_between_special_tokens": _BOOL, "detokenize": _BOOL,
    "skip_reading_prefix_cache": (_optional(lambda v: isinstance(v, bool)), "true, false or None"),
    "output_kind": (lambda v: isinstance(v, str | enum.Enum), "a RequestOutputKind or its name"),
    "stream_interval": (_optional(is_int), "an integer or None"),
    "skip_clone": _BOOL,
    "extra_args": (_optional(lambda v: isinstance(v, dict)), "a dict or None"),
}


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

    As in vLLM: a request that ends on EOS has ``stop_reason=None``; a ``stop_token_ids`` match
    sets it to that id, a stop string to that string. The text of a stop token (EOS included)
    and a stop string are left out of ``text`` unless ``include_stop_str_in_output``.
    ``logprobs=-1`` / ``prompt_logprobs=-1`` ask for the whole vocabulary (within the
    instance's ``max_logprobs``). ``detokenize=False`` returns token ids with an empty text;
    ``spaces_between_special_tokens=False`` writes adjacent special tokens without a space
    between them (with ``skip_special_tokens=False``); ``skip_reading_prefix_cache`` computes
    the whole prompt afresh. ``output_kind``, ``stream_interval``, ``skip_clone`` and
    ``extra_args`` are accepted and change nothing offline (as in vLLM's ``LLM``). The vLLM
    fields in ``UNSUPPORTED_FIELDS`` are refused by name unless they ask for nothing.
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
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    skip_reading_prefix_cache: bool | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None
    skip_clone: bool = False
    extra_args: dict[str, Any] | None = None
    # vLLM's fields that tapllm refuses unless they ask for nothing (UNSUPPORTED_FIELDS)
    watermarking: bool | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    flat_logprobs: bool = False
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None
    _stop: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop = tuple(self.stop) if self.stop is not None else ()
        self.stop_token_ids = [int(t) for t in self.stop_token_ids] if self.stop_token_ids is not None else []
        if self.hidden_states is not None:
            self.hidden_states = HiddenStatesSpec.from_any(self.hidden_states)
        if self.steering is not None:
            if isinstance(self.steering, Steer | dict):
                self.steering = [self.steering]
            self.steering = [Steer.from_any(s) for s in self.steering]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        if isinstance(self.output_kind, str) and self.output_kind.upper() in RequestOutputKind.__members__:
            self.output_kind = RequestOutputKind[self.output_kind.upper()]
        elif isinstance(getattr(self.output_kind, "value", None), int):  # vLLM's own enum
            self.output_kind = RequestOutputKind(self.output_kind.value)
        self.validate()

    @classmethod
    def encode(cls, hidden_states: HiddenStatesSpec | dict[str, Any]) -> SamplingParams:
        """The parameters of a prompt-only request capturing ``hidden_states`` (``LLM.encode``, the
        server's ``/v1/hidden_states`` and embeddings): the one place they are built."""
        return cls(max_tokens=1, temperature=0, hidden_states=hidden_states)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and its limit if a value is out of range.

        Values are checked as the sampler will use them: as float32 numbers on the device.
        """
        self._check_types()
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, or None for the rest of the context, "
                             f"got {self.max_tokens!r}")
        temperature = real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        top_p = real("top_p", self.top_p)
        if not 0 < top_p <= 1 or np.float32(top_p) == 0:
            raise ValueError(f"top_p must be in (0, 1] and at least {np.finfo(np.float32).smallest_subnormal:.3g} "
                             f"(the smallest float32 above 0), got {top_p}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0, or -1 or 0 to disable it, got {self.top_k!r}")
        min_p = real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise ValueError(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, got {value!r}")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError("stop must hold non-empty strings")
        for s in self._stop:
            check_unicode(s, "stop")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must hold non-negative integers")
        if self._stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (the text is what they are found in)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens",
                     "detokenize", "skip_clone"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")
            self.structured_outputs.validate()
        self._validate_controls()
        self._validate_vllm_fields()

    def _check_types(self) -> None:
        """``ValueError`` naming the first field whose value is of a type it does not take (``FIELD_TYPES``)."""
        for name, (accepts, what) in FIELD_TYPES.items():
            value = getattr(self, name)
            if not accepts(value):
                raise ValueError(f"{name} must be {what}, got {kind(value)}")

    def _validate_vllm_fields(self) -> None:
        """vLLM's remaining fields: the ones tapllm takes, then those it refuses by name."""
        if self.skip_reading_prefix_cache is not None and not isinstance(self.skip_reading_prefix_cache, bool):
            raise ValueError(f"skip_reading_prefix_cache must be true, false or None, got "
                             f"{self.skip_reading_prefix_cache!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                             f"got {self.output_kind!r}")
        if self.stream_interval is not None and (not is_int(self.stream_interval) or self.stream_interval < 1):
            raise ValueError(f"stream_interval must be an integer >= 1 or None, got {self.stream_interval!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        for name, neutral in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
                raise ValueError(f"{name} is not supported by tapllm (got {value!r}); leave it at "
                                 f"{neutral[0]!r}")

    def _validate_controls(self) -> None:
        """The vLLM logits controls and ``n``/``best_of`` (vocabulary checks come at admission)."""
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        repetition = real("repetition_penalty", self.repetition_penalty)
        if not repetition > 0 or np.float32(repetition) == 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off) and not round to 0 in float32, got {repetition}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for tid, bias in self.logit_bias.items():
                if not is_int(tid) or tid < 0:
                    raise ValueError(f"logit_bias: key {tid!r} is not a token id (an integer >= 0)")
                real(f"logit_bias[{tid}]", bias)
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.bad_words is not None:
            for i, word in enumerate(self.bad_words):
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words[{i}] must be a non-empty string, got {word!r}")
                check_unicode(word, f"bad_words[{i}]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids (or None for all)")
            if any(not is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must hold token ids (integers >= 0)")
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for the model's context, got {k!r}")

    @property
    def num_samples(self) -> int:
        """How many completions are generated: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_logits_controls(self) -> bool:
        """True when any logits control (penalties, bias, bans, allowed ids, min_tokens) is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0, or below 1e-5 as in vLLM)."""
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple."""
        return self._stop


LOGIT_BIAS_LIMIT = 100.0  # vLLM (and OpenAI) clamp biases to [-100, 100]


def _logit_bias(bias: dict[Any, Any]) -> dict[Any, Any]:
    """Keys as ints (OpenAI sends them as strings), finite values clamped to [-100, 100]; bad entries are
    left for ``validate`` to name."""
    out: dict[Any, Any] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if is_real(value) and math.isfinite(float(value)):
            value = min(max(float(value), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
        out[key] = value
    return out
