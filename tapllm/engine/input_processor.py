"""Admission: turns a prompt and its parameters into an ``EngineCoreRequest``, or refuses it.

Everything that can be refused is refused here, with a ``ValueError`` (``TypeError`` for a
wrong type) naming the field and its limit: the prompt, the sampling values, the
hidden-state spec and the steers against the model and the instance's policy. Specs,
steering vectors, logits controls and grammars are resolved once, here, into plain data
(``engine/core_request.py``) that needs no model: an API server process prepares requests
with the model's configuration and point shapes alone. Nothing is scheduled, and nothing is
put on the engine's device, until the engine's ``add``.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.logits_processors import resolve_controls, tokenize_bad_words
from tapllm.engine.chat import render_chat
from tapllm.hidden_states.resolved import Selection, resolve
from tapllm.hidden_states.spec import PSEUDO_POINTS
from tapllm.sae.features import resolve_features
from tapllm.sampling_params import SamplingParams
from tapllm.steering.resolved import ResolvedSteer, resolve_steering
from tapllm.steering.router import router_limits
from tapllm.steering.spec import steering_digest
from tapllm.structured.compiler import GrammarCompiler
from tapllm.tap import PSEUDO_LAYER
from tapllm.utils.platform import resolve_device
from tapllm.utils.text import check_unicode


class InputProcessor:
    """Prepares requests for one engine: its model's configuration, its instance policy, its tokenizer.

    ``point_shapes`` are the row shapes of the points inside attention and the MLP, read off the
    model's modules; ``context_limited_by_cache`` says that ``max_model_len`` was capped to the
    KV cache (error messages say so).
    """

    def __init__(self, model_config: ModelConfig, config: EngineConfig, tokenizer: Any,
                 point_shapes: dict[str, tuple[int, ...]], context_limited_by_cache: bool = False) -> None:
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        self.point_shapes = point_shapes
        self.router = router_limits(model_config)  # an MoE model's routers (None when dense): steers checked
        self.context_limited_by_cache = context_limited_by_cache
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        self._ids = itertools.count()

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None
                    ) -> str:
        """A conversation rendered with the chat template (messages checked first; see ``tokenizer.render_chat``)."""
        return render_chat(self.tokenizer, messages, add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)

    def prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        encode: bool = False,
        request_id: str | None = None,
    ) -> EngineCoreRequest:
        """Tokenize, check and resolve one request; ``LLMEngine.add`` schedules the result.

        Everything that can be refused is refused here, with a ``ValueError`` (``TypeError``
        for a wrong type) naming the field and its limit: the prompt, the sampling values as
        the sampler will use them, the hidden-state spec and the steers against the model and
        the instance's policy, a structured-output grammar (compiled once to check it). Each
        is resolved once, here. ``encode`` runs the prompt for its hidden states only.
        """
        text, token_ids = self._tokenize(prompt)
        params.validate()
        params = self._whole_vocab_logprobs(params)
        if params.truncate_prompt_tokens is not None and not encode:
            keep = params.truncate_prompt_tokens
            token_ids = token_ids[-(self.model_config.max_model_len if keep == -1 else keep):]
        self._check_prompt(token_ids, params, encode)
        if not encode:
            self._check_samples(params)
        rid = request_id if request_id is not None else str(next(self._ids))
        room = self.model_config.max_model_len - len(token_ids)
        max_tokens = 1 if encode else (params.max_tokens if params.max_tokens is not None else room)
        req = EngineCoreRequest(rid, text, token_ids, params, encode_only=encode, max_tokens=max_tokens)
        if params.skip_reading_prefix_cache:  # a salt no other request has: nothing cached matches it
            req.salt += b"|uncached=" + f"{rid}@{time.monotonic_ns()}".encode()
        if params.hidden_states is not None:
            req.selection = self._selection(token_ids, params, encode, max_tokens)
            if encode and params.prompt_logprobs is None:
                req.depth = self._depth(req.selection)
                if req.depth is not None:  # blocks past it hold no KV: never shared with a full forward
                    req.salt += b"|depth=%d" % req.depth
        if not encode:
            mc = self.model_config
            bad_words = tokenize_bad_words(self.tokenizer, params.bad_words or ())
            req.controls = resolve_controls(params, mc.vocab_size, mc.eos_token_ids, bad_words)
            req.track_cumulative = params.num_samples > params.n
        if params.steering:
            # KV computed under a steer is shared only with requests under the same steers at the
            # same positions (Request.block_salt); unsteered blocks stay shareable with everyone.
            req.steers = self._steering(params)
            req.steering_digest = steering_digest(params.steering)
        if params.structured_outputs is not None and not encode:
            req.grammar = self.grammars.compile(params.structured_outputs)  # compiled here, once per spec
        return req

    def _whole_vocab_logprobs(self, params: SamplingParams) -> SamplingParams:
        """``params`` with ``logprobs=-1`` / ``prompt_logprobs=-1`` (vLLM's whole vocabulary) made the vocabulary size."""
        if -1 not in (params.logprobs, params.prompt_logprobs):
            return params
        vocab = self.model_config.vocab_size
        return dataclasses.replace(params, logprobs=vocab if params.logprobs == -1 else params.logprobs,
                                   prompt_logprobs=vocab if params.prompt_logprobs == -1 else params.prompt_logprobs)

    def _depth(self, selection: Selection) -> int | None:
        """Blocks a prompt-only request capturing ``selection`` needs run (``None``: all of them)."""
        points = selection.tap_points()  # the SAE's input counts too
        if "final" in points:
            return None
        keys = [k for p in points if p not in PSEUDO_POINTS for k in selection.tap_keys(p)]
        depth = max(keys) + 1 if keys else 0
        return None if depth >= self.model_config.num_layers else depth

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_unicode(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, bytes | bytearray | memoryview):
            raise TypeError("prompt is bytes: pass text as str (decode it first) or token ids as a list of ints")
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence):
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        try:
            return None, [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError("prompt token ids must be integers") from None

    def _check_prompt(self, token_ids: list[int], params: SamplingParams, encode: bool) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        limit = self.model_config.max_model_len
        why = (" (capped to what the KV cache holds: raise kv_cache_blocks or kv_cache_memory_gb)"
               if self.context_limited_by_cache else "")
        if encode and len(token_ids) > limit:
            raise ValueError(f"prompt is {len(token_ids)} tokens; the model's context (max_model_len) is {limit}{why}")
        if not encode and len(token_ids) >= limit:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; the model's context (max_model_len) is {limit}{why} "
                "and must leave room for at least one generated token"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and self.config.max_logprobs != -1 and value > self.config.max_logprobs:
                raise ValueError(f"{name}: {value} requested, more than max_logprobs={self.config.max_logprobs} "
                                 "(the instance's limit)")

    def _check_samples(self, params: SamplingParams) -> None:
        """``n`` / ``best_of`` against the instance: all samples of a prompt run at once."""
        limit = self.config.max_num_seqs
        if params.num_samples > limit:
            name = "best_of" if params.best_of is not None else "n"
            raise ValueError(f"{name}: {params.num_samples} samples of one prompt, more than max_num_seqs={limit} "
                             "(the instance's limit on sequences running at once)")

    def _steering(self, params: SamplingParams) -> list[ResolvedSteer]:
        """Resolve the request's steers against the model and apply the instance policy."""
        if not self.config.enable_steering:
            raise ValueError("steering: this instance was started with enable_steering=False")
        mc = self.model_config
        return resolve_steering(params.steering, mc.num_layers, mc.hidden_size, mc.dtype,
                                self.config.max_steers_per_request, self.point_shapes, self.router)

    def _selection(self, token_ids: list[int], params: SamplingParams, encode: bool, max_tokens: int) -> Selection:
        """Resolve the request's hidden-state spec and apply the instance policy."""
        if not self.config.enable_hidden_states:
            raise ValueError("hidden_states: this instance was started with enable_hidden_states=False")
        mc, p = self.model_config, len(token_ids)
        where = params.hidden_states.device
        if where is not None and torch.device(where).type != "cpu":
            model_device = resolve_device(self.config.device)  # the engine's, wherever this request is prepared
            if not _same_device(torch.device(where), model_device):
                raise ValueError(f"hidden_states.device={where!r}: states can stay only on the model's device "
                                 f"({model_device}) or go to 'cpu'")
        end = p if encode else min(p + max_tokens, mc.max_model_len) - 1
        sel = resolve(
            params.hidden_states, num_layers=mc.num_layers, hidden_size=mc.hidden_size, model_dtype=mc.dtype,
            num_prompt=p, max_positions=end, encode=encode, vocab_size=mc.vocab_size,
            point_shapes=self.point_shapes,
        )
        if params.hidden_states.sae is not None:  # SAE features (the engine moves the SAE to its device)
            sel.features = resolve_features(params.hidden_states, num_layers=mc.num_layers,
                                            hidden_size=mc.hidden_size, point_shapes=self.point_shapes,
                                            pseudo_layer=PSEUDO_LAYER)
        limit = self.config.hidden_states_max_bytes_per_request
        samples = 1 if encode else params.num_samples
        if limit is not None and sel.max_bytes * samples > limit:
            per = f" (its {samples} samples x {sel.max_bytes:,})" if samples > 1 else ""
            raise ValueError(
                f"hidden_states: this request could capture up to {sel.max_bytes * samples:,} bytes{per} "
                f"({sel.max_positions} positions x {sum(sel.row_size(q) for q in sel.points):,} numbers a position "
                f"x {sel.dtype}), over hidden_states_max_bytes_per_request={limit:,}; "
                "select fewer layers or positions, reduce, project, or use a smaller dtype"
            )
        return sel


def _same_device(a: torch.device, b: torch.device) -> bool:
    """True when ``a`` names ``b`` (``cuda`` without an index is the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index
