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
from tapllm.outputs import CompletionOutput, Logprob, RequestOutput
from tapllm.tokenizer import IncrementalDetokenizer


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
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)

    def append_token(self, req: Request, token: int) -> Finish | None:
        """Append ``token`` to ``req`` and its text; returns why it ends now, or None to go on.

        A stop string cuts the text where it starts. As in vLLM, nothing stops a request
        before ``min_tokens`` (its sampler bans EOS and stop ids too).
        """
        req.token_ids.append(token)
        p = req.params
        try:
            delta = req.detokenizer.step(token)
        except Exception as exc:  # noqa: BLE001 - belongs to this request alone
            return Finish("error", None, f"detokenizing token {token} failed: {type(exc).__name__}: {exc}",
                          "server_error")
        if req.grammar is not None and (refused := req.grammar.accept(token)) is not None:
            return Finish("error", None, refused, "server_error")
        may_stop = len(req.output_token_ids) >= p.min_tokens
        if delta:
            prev = len(req.text)
            req.text += delta
            if p.stop_strings and may_stop and (hit := self._stop_string(req, prev)) is not None:
                return Finish("stop", hit)
        mc = self.model_config
        if may_stop and ((not p.ignore_eos and token in mc.eos_token_ids) or token in p.stop_token_ids):
            return Finish("stop", token)
        if req.grammar is not None and req.grammar.terminated:  # the output is complete: nothing can follow
            return Finish("stop")
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= mc.max_model_len:
            return Finish("length")
        return None

    @staticmethod
    def _stop_string(req: Request, prev_len: int) -> str | None:
        """The first stop string in the text (which is cut where it starts), looking only where new text could
        complete one."""
        longest = max(len(s) for s in req.params.stop_strings)
        begin = max(0, prev_len - longest + 1)
        hits = [(req.text.find(s, begin), s) for s in req.params.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        idx, s = min(hits)
        req.text = req.text[:idx]
        return s

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
            if not sample.finished and sample.params.stop_strings:
                end = max(sent[1], end - (max(len(s) for s in sample.params.stop_strings) - 1))
            if not tokens and end == sent[1]:
                continue
            logprobs = sample.logprobs[sent[0] :] if sample.logprobs is not None else None
            out.append(Delta(sample.sample_index, sample.text[sent[1] : end], tokens, logprobs))
            sent[0] += len(tokens)
            sent[1] = end
        return out

    def _decoded(self, entries: list | None) -> list | None:
        """Logprob entries with each token's text filled in."""
        for entry in entries or ():
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
            prompt_logprobs=self._decoded(req.prompt_logprobs),
            error=error,
            error_type=error_type,
        )

    def _completion(self, s: Request) -> CompletionOutput:
        self._decoded(s.logprobs)
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
