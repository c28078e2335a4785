"""What the API writes: choices (whole or streamed), logprobs, hidden states on the wire, usage, SSE.

One builder, :meth:`ChoiceFormat.choice`, writes every choice of ``/v1/completions`` and
``/v1/chat/completions``, whole or as a stream chunk. Everything here returns plain dicts
that ``errors.encode`` turns into strict JSON.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tapllm.hidden_states.json_codec import hidden_states_to_wire
from tapllm.outputs import CompletionOutput, Logprob, RequestOutput
from tapllm.server.errors import ERROR_STATUS, dumps, error_body, finite_or_none

# What OpenAI-compatible servers write for a log probability of -inf (vLLM's value).
MIN_LOGPROB = -9999.0

DONE = "data: [DONE]\n\n"

LogprobEntries = list[dict[int, Logprob]]


@dataclass(frozen=True, slots=True)
class ChoiceFormat:
    """How one response writes its choices.

    ``chat``: a ``message`` (a ``delta`` when ``stream``) instead of ``text``;
    ``top_logprobs``: alternatives per token (``None``: no logprobs at all).
    """

    tokenizer: Any
    chat: bool
    stream: bool
    top_logprobs: int | None

    def choice(self, index: int, text: str, token_ids: list[int], logprobs: LogprobEntries | None, *,
               final: CompletionOutput | None = None, hidden_states: dict[str, Any] | None = None,
               role: str | None = None) -> dict[str, Any]:
        """One choice: ``text`` and its tokens (the whole completion, or a stream's latest delta).

        ``final`` (the finished completion) adds its finish and stop reasons; ``role`` opens a
        chat stream.
        """
        c: dict[str, Any] = {"index": index}
        if not self.chat:
            c["text"] = text
        elif not self.stream:
            c["message"] = {"role": "assistant", "content": text}
        elif role is not None:
            c["delta"] = {"role": role, "content": text}
        else:
            c["delta"] = {"content": text} if text else {}
        c["logprobs"] = self._logprobs(token_ids, logprobs)
        c["finish_reason"] = final.finish_reason if final is not None else None
        if final is not None:
            c["stop_reason"] = final.stop_reason
        if hidden_states is not None:
            c["hidden_states"] = hidden_states
        return c

    def _logprobs(self, token_ids: list[int], entries: LogprobEntries | None) -> Any:
        if self.top_logprobs is None or entries is None:
            return None
        if self.chat:
            return {"content": chat_logprobs(token_ids, entries, self.tokenizer, self.top_logprobs)}
        return completion_logprobs(token_ids, entries, self.tokenizer, self.top_logprobs)


def _logprob(value: float) -> float | None:
    """A log probability as JSON can carry it: -inf as ``MIN_LOGPROB``, NaN as null."""
    if math.isnan(value):
        return None
    return max(value, MIN_LOGPROB)


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely tokens of an entry (which also holds the chosen token)."""
    return sorted(entry.items(), key=lambda kv: kv[1].rank)[:n]


def _with_chosen(entry: dict[int, Logprob], token: int, n: int) -> list[tuple[int, Logprob]]:
    """``token`` (the sampled or prompt token), then the top ``n`` of the entry: ``n + 1`` tokens when
    ``token`` is not among the top ``n`` (vLLM's and OpenAI's ``top_logprobs`` of completions)."""
    return [(token, entry[token]), *((k, v) for k, v in _top(entry, n) if k != token)]


def completion_logprobs(token_ids: list[int], entries: LogprobEntries | None, tokenizer: Any, n: int
                        ) -> dict[str, Any] | None:
    """``/v1/completions`` logprobs: tokens, their logprobs, each token with the top ``n`` and text offsets.

    Each ``top_logprobs`` entry holds the token itself and the top ``n`` (as vLLM writes them): echoed
    prompt tokens and sampled tokens outside the top ``n`` are there too.
    """
    if entries is None:
        return None
    tokens, chosen, tops = [], [], []
    for t, entry in zip(token_ids, entries):
        tokens.append(tokenizer.decode([t]))
        if entry is None:  # an echoed prompt's first token: nothing predicts it
            chosen.append(None)
            tops.append(None)
            continue
        chosen.append(_logprob(entry[t].logprob))
        tops.append({tokenizer.decode([k]): _logprob(v.logprob) for k, v in _with_chosen(entry, t, n)})
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then ``{token_id: {logprob, rank,
    decoded_token}}`` per token."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _logprob(lp.logprob), "rank": lp.rank,
                                            "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def chat_logprobs(token_ids: list[int], entries: LogprobEntries | None, tokenizer: Any, n: int
                  ) -> list[dict[str, Any]] | None:
    """``/v1/chat/completions`` logprobs ``content``: one entry a token, with its top ``n``."""
    if entries is None:
        return None
    out = []
    for t, entry in zip(token_ids, entries):
        s = tokenizer.decode([t])
        top = [{"token": tokenizer.decode([k]), "logprob": _logprob(v.logprob),
                "bytes": list(tokenizer.decode([k]).encode())} for k, v in _top(entry, n)]
        out.append({"token": s, "logprob": _logprob(entry[t].logprob), "bytes": list(s.encode()),
                    "top_logprobs": top})
    return out


def hidden_states_json(hs: Any, encoding: str) -> dict[str, Any]:
    """A ``HiddenStates`` on the wire; with ``"list"``, non-finite values (an empty reduction) are null."""
    wire = hidden_states_to_wire(hs, encoding)
    if encoding == "list":  # JSON has no NaN: an empty reduction window is written as null
        for point, tensor in hs.items():
            if not bool(torch.isfinite(tensor).all()):
                wire["points"][point]["data"] = finite_or_none(wire["points"][point]["data"])
    return wire


def usage(outputs: Iterable[RequestOutput]) -> dict[str, int]:
    """``usage`` of finished requests: prompt, completion and total tokens."""
    p = c = 0
    for out in outputs:
        p += len(out.prompt_token_ids)
        c += sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def model_card(name: str, root: str, max_model_len: int, quantization: str = "none") -> dict[str, Any]:
    """One entry of ``/v1/models``, with vLLM's fields: ``root`` (the model as loaded), ``parent`` (``None``: not
    an adapter), ``max_model_len``, one permission object (everything allowed but fine-tuning), and tapllm's
    ``quantization`` of the weights ("none", "int8", "int4-g128", ...)."""
    now = int(time.time())
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    return {"id": name, "object": "model", "created": now, "owned_by": "tapllm", "root": root, "parent": None,
            "max_model_len": max_model_len, "permission": [permission], "quantization": quantization}


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {dumps(obj)}\n\n"


def sse_error(message: str, kind: str) -> str:
    """The error event that ends a stream, then ``[DONE]``."""
    return sse(error_body(message, ERROR_STATUS.get(kind, 500))) + DONE
