"""When a request stops and what its text keeps, as vLLM decides it (no engine state here).

- A token ends a request when it is the tokenizer's EOS (``stop_reason`` None: no stop the user
  asked for), a ``stop_token_ids`` entry, or another EOS id of the model's generation config
  (vLLM adds those to the stop ids, so ``stop_reason`` is the id). ``ignore_eos`` turns both
  EOS kinds off; a ``stop_token_ids`` entry still stops.
- The text of a token that ended the request is left out unless ``include_stop_str_in_output``;
  its id stays in ``token_ids``.
- A stop string cuts the text where it begins (after it ends with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tapllm.sampling_params import SamplingParams


def primary_eos(tokenizer_eos: int | None, eos_token_ids: Sequence[int]) -> int | None:
    """The EOS that ends a request with ``stop_reason=None``: the tokenizer's, when the model lists it
    among its EOS ids, else the model's first."""
    if tokenizer_eos is not None and tokenizer_eos in eos_token_ids:
        return tokenizer_eos
    return eos_token_ids[0] if eos_token_ids else None


def token_stop(token: int, params: SamplingParams, eos: int | None, eos_token_ids: Sequence[int]
               ) -> tuple[bool, int | None]:
    """``(stops, stop_reason)`` for a sampled ``token``; ``eos`` is :func:`primary_eos`."""
    if not params.ignore_eos and token == eos:
        return True, None
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return True, token
    return False, None


def keeps_text(params: SamplingParams, stopped_by_token: bool) -> bool:
    """Whether the text of the token just sampled goes into the output text."""
    return params.detokenize and (params.include_stop_str_in_output or not stopped_by_token)


def find_stop_string(text: str, new_chars: int, params: SamplingParams) -> tuple[str, int] | None:
    """``(stop string, length to cut the text to)`` if one ends in the last ``new_chars`` characters.

    The stop string that ends earliest wins (ties: the first in ``params.stop``).
    """
    if not new_chars:
        return None
    best: tuple[int, str, int] | None = None
    for s in params.stop_strings:
        at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if at >= 0 and (best is None or at + len(s) < best[0]):
            best = (at + len(s), s, at)
    if best is None:
        return None
    end, s, at = best
    return s, (end if params.include_stop_str_in_output else at)


def held_back(params: SamplingParams) -> int:
    """Characters a stream holds back until the request finishes: what could still turn out to be the
    start of a stop string that the text leaves out."""
    if not params.stop_strings or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop_strings) - 1
