"""Admission: an HTTP request's prompts checked and prepared for the engine (runs in a worker thread).

Each prompt becomes an ``EngineCoreRequest`` through ``InputProcessor.prepare``, once (with an
engine core process too: what it receives is this request, not the prompt), which refuses
what the engine cannot serve with an error naming the field. Around it the server adds its own
bounds: a string prompt whose UTF-8 length could not fit the context even at the
vocabulary's longest token is refused without tokenizing it; ``max_tokens`` must fit the
context with the prompt; and the hidden states of all the prompts of one HTTP request
together must fit ``--hidden-states-max-bytes``. Every refusal is an ``APIError``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from typing import Any

from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.input_processor import InputProcessor
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.sampling_params import SamplingParams
from tapllm.server.errors import APIError, check_text, param_of
from tapllm.server.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    HiddenStatesOnlyRequest,
    PromptInput,
    _Sampling,
)

logger = logging.getLogger("tapllm")

# The fields an error message may start by naming: the bodies' and the engine's (SamplingParams, specs).
_FIELDS = frozenset({*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields,
                     *HiddenStatesOnlyRequest.model_fields, *(f.name for f in dataclasses.fields(SamplingParams))})

# The structured-output fields an error message may name (a schema that does not compile, two given).
_STRUCTURED_FIELD = re.compile(r"\b(?:response_format|structured_outputs|guided_json|guided_regex|guided_choice|"
                               r"guided_grammar)[\w.\[\]]*")


class Admission:
    """Turns parsed bodies into ``EngineCoreRequest`` objects named ``{request_id}-{i}`` with the
    engine's input processor (the ``LLMEngine``'s, or an API server's ``EngineFrontend``'s)."""

    def __init__(self, processor: InputProcessor, served_model_name: str, max_prompts_per_request: int) -> None:
        self.processor = processor
        self.served_model_name = served_model_name
        self.max_prompts_per_request = max_prompts_per_request
        self.max_len = processor.model_config.max_model_len
        self.longest_token, self.text_limit = _text_limit(processor.tokenizer, self.max_len)
        logger.info("prompts over %s bytes of UTF-8 are refused before tokenizing (%d tokens x %d bytes, the "
                    "longest token)", f"{self.text_limit:,}", self.max_len, self.longest_token)

    # ---- the three bodies ------------------------------------------------------------------
    def completion(self, body: CompletionRequest, request_id: str) -> list[EngineCoreRequest]:
        """The prompts of a ``/v1/completions`` body."""
        self._check_common(body)
        self._check_logprobs(body.logprobs, "logprobs")
        prompts = _prompt_list(body.prompt, "prompt", self.max_prompts_per_request)
        # echo with max_tokens=0 scores the prompt alone (vLLM): one token is run, then dropped
        max_tokens = 1 if body.echo and body.max_tokens == 0 else body.max_tokens
        params = self._params(body, max_tokens)  # None: the rest of each prompt's context
        return self._prepare_all(prompts, params, False, "prompt", request_id, body.add_special_tokens)

    def chat(self, body: ChatCompletionRequest, request_id: str) -> EngineCoreRequest:
        """The conversation of a ``/v1/chat/completions`` body, rendered and tokenized once."""
        self._check_common(body)
        if body.logprobs:
            self._check_logprobs(body.top_logprobs, "top_logprobs")
        text = self.render_chat(body)
        self._check_prompt_text(text, "messages")
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
        prompt = text if body.add_special_tokens else self.processor.tokenizer.encode(text, add_special_tokens=False)
        return self._prepare(prompt, self._params(body, max_tokens), False, f"{request_id}-0", "")

    def render_chat(self, body: Any) -> str:
        """A chat body's conversation as prompt text (``messages``, ``add_generation_prompt``,
        ``continue_final_message``, ``chat_template_kwargs``); ``APIError`` names the field."""
        try:
            return self.processor.render_chat(_conversation(body), body.add_generation_prompt,
                                              continue_final_message=body.continue_final_message,
                                              chat_template_kwargs=body.chat_template_kwargs)
        except (ValueError, TypeError) as exc:  # the template refused these messages or options
            msg = str(exc)
            param = next((f for f in ("chat_template_kwargs", "continue_final_message") if msg.startswith(f)),
                         "messages")
            raise APIError(400, msg, param=param) from None

    def hidden_states(self, body: HiddenStatesOnlyRequest, request_id: str) -> list[EngineCoreRequest]:
        """The prompts of a ``/v1/hidden_states`` body (prompt-only, like ``LLM.encode``)."""
        self._check_common(body)
        prompts = _prompt_list(body.input, "input", self.max_prompts_per_request)
        try:
            params = SamplingParams.encode(body.hidden_states.to_spec())
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=_param(str(exc))) from None
        return self._prepare_all(prompts, params, True, "input", request_id)

    # ---- shared checks ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is ``None`` or the served model's name."""
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", param="model")

    def encode_prompts(self, prompts: PromptInput, spec: HiddenStatesSpec, field: str, request_id: str,
                       add_special_tokens: bool = True) -> list[EngineCoreRequest]:
        """Prompt-only requests capturing ``spec`` (like ``LLM.encode``), e.g. the embeddings'."""
        if not self.processor.config.enable_hidden_states:
            raise APIError(400, "this server does not serve hidden states or embeddings (start it with "
                           "--enable-hidden-states)", param=field)
        params = SamplingParams.encode(spec)
        return self._prepare_all(_prompt_list(prompts, field, self.max_prompts_per_request), params, True, field,
                                 request_id, add_special_tokens)

    def _check_common(self, body: _Sampling | HiddenStatesOnlyRequest) -> None:
        self.check_model(body.model)
        config = self.processor.config
        if isinstance(body, _Sampling) and (problem := body.unsupported()):
            raise APIError(400, problem, param=_param(problem))
        wants_states = isinstance(body, HiddenStatesOnlyRequest) or body.hidden_states is not None \
            or body.sae_features is not None
        if wants_states and not config.enable_hidden_states:
            raise APIError(400, "this server does not serve hidden states (start it with --enable-hidden-states)",
                           param="hidden_states")
        if isinstance(body, _Sampling) and body.steering and not config.enable_steering:
            raise APIError(400, "this server does not serve steering (start it with --enable-steering)",
                           param="steering")
        if isinstance(body, _Sampling):
            stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
            for i, s in enumerate(stops):
                check_text(s, "stop" if isinstance(body.stop, str) else f"stop[{i}]")

    def _check_logprobs(self, value: int | None, field: str) -> None:
        if value is None:
            return
        limit = self.processor.config.max_logprobs
        if value < 0:
            raise APIError(400, f"{field} must be >= 0, got {value}", param=field)
        if limit != -1 and value > limit:
            raise APIError(400, f"{field}: {value} requested, more than this server's max_logprobs={limit}",
                           param=field)

    @staticmethod
    def _params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, body.num_logprobs())
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=_param(str(exc))) from None

    def _check_prompt_text(self, prompt: str, name: str) -> None:
        """Refuse text that cannot fit the context without tokenizing it; check it is valid Unicode."""
        # A character is at least one byte: only a prompt that may fit is encoded to measure it.
        ascii_only = prompt.isascii()
        exact = ascii_only or len(prompt) <= self.text_limit
        size = len(prompt) if ascii_only or not exact else len(prompt.encode("utf-8", "surrogatepass"))
        if size > self.text_limit:
            raise APIError(400, f"{name} is {'' if exact else 'at least '}{size:,} bytes of text, more than the "
                           f"model's context of {self.max_len} tokens can hold (at most {self.longest_token} bytes "
                           "a token): shorten it", param=name)
        check_text(prompt, name)

    def _prepare(self, prompt: str | list[int], params: SamplingParams, encode: bool, request_id: str,
                 prefix: str) -> EngineCoreRequest:
        """``InputProcessor.prepare``, then max_tokens against the context; errors start with ``prefix``."""
        try:
            req = self.processor.prepare(prompt, params, encode=encode, request_id=request_id)
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"{prefix}{exc}", param=_param(str(exc))) from None
        n = req.num_prompt_tokens
        if not encode and n + req.max_tokens > self.max_len:
            raise APIError(400, f"{prefix}max_tokens: the prompt has {n} tokens and max_tokens is "
                           f"{req.max_tokens}, over the model's context of {self.max_len}; use max_tokens <= "
                           f"{self.max_len - n}", param="max_tokens")
        return req

    def _prepare_all(self, prompts: Sequence[str | list[int]], params: SamplingParams, encode: bool, field: str,
                     request_id: str, add_special_tokens: bool = True) -> list[EngineCoreRequest]:
        """Every prompt of one HTTP request; their hidden states together must fit the server's limit."""
        many = len(prompts) > 1
        reqs = []
        for i, prompt in enumerate(prompts):
            name = f"{field}[{i}]" if many else field
            if isinstance(prompt, str):
                self._check_prompt_text(prompt, name)
                if not add_special_tokens:
                    prompt = self.processor.tokenizer.encode(prompt, add_special_tokens=False)
            reqs.append(self._prepare(prompt, params, encode, f"{request_id}-{i}", f"{name}: " if many else ""))
        total = sum(r.max_hidden_states_bytes for r in reqs)
        limit = self.processor.config.hidden_states_max_bytes_per_request
        if limit is not None and total > limit:
            raise APIError(400, f"hidden_states: the {len(reqs)} prompts of this request could capture up to "
                           f"{total:,} bytes together, over this server's limit of {limit:,} bytes a request "
                           "(--hidden-states-max-bytes); send fewer prompts per request, or select fewer layers "
                           "or positions, reduce, project, or use a smaller dtype", param="hidden_states")
        return reqs


def _param(message: str) -> str | None:
    """The request field an error message names: a structured-output field anywhere in it, else the
    field it starts with."""
    found = _STRUCTURED_FIELD.search(message)
    return found.group(0).rstrip(".") if found else param_of(message, _FIELDS)


def _text_limit(tokenizer: Any, max_len: int) -> tuple[int, int]:
    """``(longest token in UTF-8 bytes, most bytes of text a prompt of max_len tokens can be)``.

    A token stands for at most as many bytes of text as its longest spelling, in the vocabulary
    (byte-level, SentencePiece: never shorter than the text) or decoded. A tokenizer with a
    normalizer may shrink text before splitting it (NFKC, stripped accents), so the limit
    keeps a margin of 4x there: a heuristic bound; tokenization still has the final word.
    """
    vocab = tokenizer.get_vocab()
    longest = 1
    for token in vocab:
        spelled = len(token.encode("utf-8", "surrogatepass"))
        decoded = len(tokenizer.convert_tokens_to_string([token]).encode("utf-8", "surrogatepass"))
        longest = max(longest, spelled, decoded)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    margin = 4 if backend is None or backend.normalizer is not None else 1
    return longest, max_len * longest * margin


def _prompt_list(prompt: PromptInput, field: str, limit: int) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{field} is empty", param=field)
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if len(prompt) > limit:
        raise APIError(400, f"{field}: {len(prompt)} prompts in one request, more than this server's limit of "
                       f"{limit} (--max-prompts-per-request)", param=field)
    return list(prompt)  # type: ignore[arg-type]


def _conversation(body: Any) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` text; ``APIError`` names the faulty field."""
    if not body.messages:
        raise APIError(400, "messages is empty", param="messages")
    conversation = []
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if not m.role:
            raise APIError(400, f"{where}.role must be a non-empty string", param=f"{where}.role")
        check_text(m.role, f"{where}.role")
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"{where}.content is required for a {m.role!r} message", param=f"{where}.content")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                   "are supported", param=f"{where}.content")
                check_text(part["text"], f"{where}.content[{j}].text")
        elif isinstance(m.content, str):
            check_text(m.content, f"{where}.content")
        message = {"role": m.role, "content": m.text()}
        if m.name is not None:
            check_text(m.name, f"{where}.name")
            message["name"] = m.name
        conversation.append(message)
    return conversation
