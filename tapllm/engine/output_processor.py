"""Stops, detokenization, stream deltas and outputs: what the engine makes of sampled tokens.

One place for the whole of stopping, for ``LLM``, the server and collect alike: a sampled
token is appended, detokenized and checked against the grammar, stop strings, stop tokens,
EOS, ``max_tokens`` and the context (:meth:`OutputProcessor.append_token`); while a request
streams, text that could still become the start of a stop string is held back
(:meth:`OutputProcessor.deltas`); when it has finished, :meth:`OutputProcessor.make_output`
builds its ``RequestOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tapllm.config import ModelConfig
from tapllm.engine.request import Request
from tapllm.engine.stops import find_stop_string, held_back, keeps_text, primary_eos, token_stop
from tapllm.engine.tokenizer import IncrementalDetokenizer
from tapllm.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True, frozen=True)
class Finish:
    """Why a request ends now: a finish reason and what matched, or an error (``error_type`` set)."""

    reason: str  # "stop" | "length" | "error"
    stop_reason: int | str | None = None
    message: str | None = None  # the error, when reason is "error"
    error_type: str | None = None


@dataclass(slots=True)
class Delta:
    """What one sample produced since the previous delta of its request."""

    index: int  # the sample (n > 1)
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None


@dataclass(slots=True)
class StreamCursor:
    """How much of each sample of a request a stream has sent: ``[tokens, chars]`` per sample index."""

    sent: dict[int, list[int]] = field(default_factory=dict)


class OutputProcessor:
    """Turns sampled tokens into text, stop decisions and outputs, for one tokenizer and model."""

    def __init__(self, tokenizer: Any, model_config: ModelConfig) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config  # its EOS ids and context (as capped to the KV cache), read at each token

    def detokenizer(self, req: Request) -> IncrementalDetokenizer:
        """A fresh detokenizer for ``req``'s output, in the context of its prompt."""
        p = req.params
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                      p.spaces_between_special_tokens)

    def append_token(self, req: Request, token: int) -> Finish | None:
        """Append ``token`` to ``req`` and its text; returns why it ends now, or None to go on.

        A stop string cuts the text where it starts. As in vLLM, nothing stops a request
        before ``min_tokens`` (its sampler bans EOS and stop ids too).
        """
        req.token_ids.append(token)
        p = req.params
        # As in vLLM, nothing stops a request before min_tokens (its sampler bans EOS and stop ids too).
        may_stop = len(req.output_token_ids) >= p.min_tokens
        mc = self.model_config
        stopped, stop_token = token_stop(token, p, primary_eos(self.tokenizer.eos_token_id, mc.eos_token_ids),
                                         mc.eos_token_ids) if may_stop else (False, None)
        if keeps_text(p, stopped):
            try:
                delta = req.detokenizer.step(token)
            except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                return Finish("error", None, f"detokenizing token {token} failed: {type(exc).__name__}: {exc}",
                              "server_error")
            req.text += delta
            if p.stop_strings and may_stop and (hit := find_stop_string(req.text, len(delta), p)) is not None:
                req.text = req.text[: hit[1]]
                return Finish("stop", hit[0])
        if req.grammar is not None and (refused := req.grammar.accept(token)) is not None:
            return Finish("error", None, refused, "server_error")
        if stopped:
            return Finish("stop", stop_token)
        if req.grammar is not None and req.grammar.terminated and not self._eos_can_follow(req):
            return Finish("stop")  # complete, and no EOS may end it: nothing can follow
        if len(req.output_token_ids) >= req.max_tokens or len(req.token_ids) >= mc.max_model_len:
            return Finish("length")
        return None

    def _eos_can_follow(self, req: Request) -> bool:
        """Whether a complete structured output ends by sampling the EOS its grammar then forces (as in vLLM):
        an EOS may end it (not ``ignore_eos``) and may be sampled next (``min_tokens`` reached)."""
        p = req.params
        return not p.ignore_eos and bool(self.model_config.eos_token_ids) and \
            len(req.output_token_ids) >= p.min_tokens

    @staticmethod
    def deltas(req: Request, cursor: StreamCursor) -> list[Delta]:
        """What each sample of ``req`` produced since ``cursor``, which advances.

        While a sample runs, text that could still turn out to be the start of a stop string
        is held back; it comes once the sample has finished (cut where a stop string began).
        """
        out = []
        for sample in req.group:
            sent = cursor.sent.setdefault(sample.sample_index, [0, 0])
            tokens = sample.output_token_ids[sent[0] :]
            end = len(sample.text)
            if not sample.finished and (hold := held_back(sample.params)):
                end = max(sent[1], end - hold)  # what could still turn out to start a stop string
            if not tokens and end == sent[1]:
                continue
            logprobs = sample.logprobs[sent[0] :] if sample.logprobs is not None else None
            out.append(Delta(sample.sample_index, sample.text[sent[1] : end], tokens, logprobs))
            sent[0] += len(tokens)
            sent[1] = end
        return out

    def _decoded(self, entries: list | None, params: Any) -> list | None:
        """Logprob entries with each token's text filled in (left ``None`` with ``detokenize=False``, as in vLLM)."""
        for entry in (entries or ()) if params.detokenize else ():
            for tid, lp in (entry or {}).items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([tid])
        return entries

    def make_output(self, req: Request) -> RequestOutput:
        """The user-facing result of a request (``outputs`` is empty for an encode request).

        With ``n`` (or ``best_of``) > 1, ``outputs`` holds ``n`` completions: in sample order, or
        with ``best_of > n`` the ``n`` of highest cumulative logprob, best first. The request's
        ``hidden_states`` are those of ``outputs[0]``; each completion has its own. A sample that
        failed makes the request's ``error`` (the other samples are still returned).
        """
        completions = [] if req.encode_only else [self._completion(s) for s in req.group]
        if req.params.num_samples > req.params.n:
            completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            completions = completions[: req.params.n]
            for i, c in enumerate(completions):
                c.index = i
        failed = next((s for s in req.group if s.error is not None), None) if not req.encode_only else None
        error, error_type = (req.error, req.error_type) if failed is None else (failed.error, failed.error_type)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=completions,
            finished=req.group_finished,
            hidden_states=completions[0].hidden_states if completions else req.hidden_states,
            metrics={"num_cached_tokens": req.num_cached_tokens,
                     "num_preemptions": sum(s.num_preemptions for s in req.group)},
            prompt_logprobs=self._decoded(req.prompt_logprobs, req.params),
            error=error,
            error_type=error_type,
        )

    def _completion(self, s: Request) -> CompletionOutput:
        self._decoded(s.logprobs, s.params)
        tracked = s.logprobs is not None or s.track_cumulative
        return CompletionOutput(
            index=s.sample_index,
            text=s.text,
            token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob if tracked else None,
            logprobs=s.logprobs,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            hidden_states=s.hidden_states,
        )
