"""The step loop: admit requests, schedule, execute, sample, detokenize, finish."""

from __future__ import annotations

import hashlib
import itertools
import logging
import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.block_manager import BlockManager
from tapllm.engine.logits_processors import resolve_controls, tokenize_bad_words
from tapllm.engine.model_runner import ModelRunner, StepResult
from tapllm.engine.prompt_logprobs import PromptLogprobs
from tapllm.engine.request import Request, RequestStatus
from tapllm.engine.sampler import RowFailure
from tapllm.engine.scheduler import ScheduledItem, Scheduler
from tapllm.hidden_states.capture import RequestCapture, Selection, resolve
from tapllm.hidden_states.spec import PSEUDO_POINTS
from tapllm.models.tap import PSEUDO_LAYER
from tapllm.sae.features import DeviceSAEs, resolve_features
from tapllm.steering.plan import ResolvedSteer, resolve_steering
from tapllm.steering.spec import steering_digest
from tapllm.structured.compiler import GrammarCompiler
from tapllm.outputs import CompletionOutput, RequestOutput
from tapllm._text import check_unicode
from tapllm.sampling_params import SamplingParams
from tapllm.loader import resolve_model, resolve_tokenizer
from tapllm.platform import resolve_device
from tapllm.tokenizer import IncrementalDetokenizer, load_chat_template, load_tokenizer, render_chat

logger = logging.getLogger("tapllm")


class LLMEngine:
    """Runs requests to completion with continuous batching over a paged KV cache.

    The public surface, used by ``LLM``, the server and ``tapllm collect`` alike:
    :meth:`prepare` (tokenize, check and resolve one request; raises naming the field),
    :meth:`add` (schedule it), :meth:`step`, :meth:`abort`, :meth:`make_output`,
    :meth:`render_chat` and :meth:`stats`.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device) -> None:
        engine_config.validate()
        self.model_config = model_config
        self.config = engine_config
        self.device = device
        self.tokenizer = load_tokenizer(model_config.tokenizer_path or model_config.path)
        if engine_config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(engine_config.chat_template)
        self.runner = ModelRunner(model_config, engine_config, device)
        self.blocks = BlockManager(
            self.runner.num_blocks, engine_config.block_size, engine_config.enable_prefix_caching
        )
        self._fit_context_to_cache()
        self.scheduler = Scheduler(engine_config, self.blocks)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(engine_config.seed)
        self.requests: dict[str, Request] = {}
        self.num_generated_tokens = 0
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        self.saes = DeviceSAEs(device)  # SAEs of features and SAE steers, on the device

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Resolve ``config``'s model, device and dtype, then load the engine."""
        config.validate()
        device = resolve_device(config.device)
        folder = resolve_model(config.model, config.revision, config.download_dir)
        model_config = ModelConfig.from_folder(folder, config.dtype, device)
        if config.tokenizer is not None:
            model_config.tokenizer_path = resolve_tokenizer(config.tokenizer, config.tokenizer_revision,
                                                            config.download_dir)
        if config.max_model_len is not None:
            if config.max_model_len > model_config.max_model_len:
                raise ValueError(f"max_model_len={config.max_model_len} is longer than the model's context "
                                 f"({model_config.max_model_len} positions)")
            model_config.max_model_len = config.max_model_len
        if config.gpu_memory_utilization is not None and device.type == "cpu":
            logger.info("gpu_memory_utilization is ignored on CPU; kv_cache_memory_gb sizes the KV cache")
        return cls(model_config, config, device)

    def _fit_context_to_cache(self) -> None:
        """Cap the context at what the KV cache holds, so every admitted request can finish.

        Like vLLM, a request is never started that could not complete alone in an empty
        cache: its prompt and generated tokens always fit, and preemption guarantees progress.
        """
        mc = self.model_config
        cache_tokens = self.runner.num_blocks * self.config.block_size
        self.context_limited_by_cache = cache_tokens < mc.max_model_len
        if self.context_limited_by_cache:
            logger.warning(
                "the KV cache holds %d tokens, fewer than the model's context of %d: max_model_len is capped to "
                "%d (raise kv_cache_blocks or kv_cache_memory_gb for longer sequences)",
                cache_tokens, mc.max_model_len, cache_tokens,
            )
            mc.max_model_len = cache_tokens

    # ---- admission -------------------------------------------------------------------
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
    ) -> Request:
        """Tokenize, check and resolve one request; nothing is scheduled until :meth:`add`.

        Everything that can be refused is refused here, with a ``ValueError`` (``TypeError``
        for a wrong type) naming the field and its limit: the prompt, the sampling values as
        the sampler will use them, the hidden-state spec and the steers against the model and
        the instance's policy. Specs and steering vectors are resolved (and moved to the
        device) once, here. ``encode`` runs the prompt for its hidden states only.
        """
        text, token_ids = self._tokenize(prompt)
        params.validate()
        if params.truncate_prompt_tokens is not None and not encode:
            keep = params.truncate_prompt_tokens
            token_ids = token_ids[-(self.model_config.max_model_len if keep == -1 else keep):]
        self._check_prompt(token_ids, params, encode)
        if not encode:
            self._check_samples(params)
        rid = request_id if request_id is not None else str(next(self._ids))
        room = self.model_config.max_model_len - len(token_ids)
        max_tokens = 1 if encode else (params.max_tokens if params.max_tokens is not None else room)
        req = Request(rid, -1, text, token_ids, params, None, encode_only=encode, max_tokens=max_tokens,
                      cache_salt=self.runner.model.prompt_salt(len(token_ids)))
        if params.hidden_states is not None:
            req.selection = self._selection(token_ids, params, encode, max_tokens)
            if encode and params.prompt_logprobs is None:
                req.depth = self._depth(req.selection)
                if req.depth is not None:  # blocks past it hold no KV: never shared with a full forward
                    req.cache_salt += b"|depth=%d" % req.depth
        if not encode:
            mc = self.model_config
            bad_words = tokenize_bad_words(self.tokenizer, params.bad_words or ())
            req.controls = resolve_controls(params, mc.vocab_size, mc.eos_token_ids, bad_words)
            req.track_cumulative = params.num_samples > params.n
        if params.steering:
            req.steering = self._steering(params)
            # KV computed under a steer is shared only with requests under the same steers at the
            # same positions (Request.block_salt); unsteered blocks stay shareable with everyone.
            req.steering_digest = steering_digest(params.steering)
        if params.structured_outputs is not None and not encode:
            req.grammar = self.grammars.matcher(params.structured_outputs)  # compiled here, once per spec
        return req

    def _depth(self, selection: Selection) -> int | None:
        """Blocks a prompt-only request capturing ``selection`` needs run (``None``: all of them)."""
        points = selection.tap_points()  # the SAE's input counts too
        if "final" in points:
            return None
        keys = [k for p in points if p not in PSEUDO_POINTS for k in selection.tap_keys(p)]
        depth = max(keys) + 1 if keys else 0
        return None if depth >= self.model_config.num_layers else depth

    def add(self, req: Request) -> None:
        """Schedule a request made by :meth:`prepare`."""
        if req.arrival >= 0:
            raise ValueError(f"request {req.request_id} was already added")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        params = req.params
        req.arrival = next(self._arrivals)
        times = req.times
        times.queued = time.monotonic()
        if times.arrival is None:
            times.arrival = times.queued
        seed = None
        if not params.greedy:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            req.generator = torch.Generator().manual_seed(seed)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
        if not req.encode_only:
            req.samples = [self._new_sample(req, i, seed) for i in range(1, params.num_samples)]
            req.forks = list(req.samples)
            for sample in req.group:
                if sample.controls is not None and sample.controls.penalized:
                    sample.counts_slot = self.runner.token_counts.acquire(sample.prompt_token_ids)
        if params.prompt_logprobs is not None:
            req.prompt_lp = PromptLogprobs(req.prompt_token_ids, params.prompt_logprobs)
        self.requests[req.request_id] = req
        if req.selection is not None:
            try:  # a reducer plugin's start() runs here
                req.capture = RequestCapture(req.selection, params.hidden_states, req.num_prompt_tokens, self.device,
                                             self.runner.model.lens_logits)
            except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                self._fail(req, f"hidden_states: starting the capture failed: {type(exc).__name__}: {exc}",
                           "server_error")
                return
        self.scheduler.add(req)

    def _new_sample(self, req: Request, index: int, seed: int | None) -> Request:
        """Sample ``index`` of ``req``'s prompt, waiting to fork from it once the prompt is computed."""
        sample = Request(f"{req.request_id}#{index}", req.arrival, req.prompt, req.prompt_token_ids, req.params,
                         None if seed is None else torch.Generator().manual_seed(sample_seed(seed, index)),
                         cache_salt=req.cache_salt, status=RequestStatus.WAITING, selection=req.selection,
                         steering=req.steering, steering_digest=req.steering_digest, max_tokens=req.max_tokens,
                         controls=req.controls, track_cumulative=req.track_cumulative, sample_index=index,
                         parent=req)
        if req.grammar is not None:  # each sample walks the grammar on its own (compiled once, cached)
            sample.grammar = self.grammars.matcher(req.params.structured_outputs)
        sample.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                    req.params.skip_special_tokens)
        return sample

    def abort(self, request_id: str) -> None:
        """Stop a request (all its samples) now and free its blocks and capture buffers (unknown ids are ignored)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        req.forks = []
        for sample in req.group:
            if not sample.finished:
                sample.status = RequestStatus.FINISHED
                sample.finish_reason = "abort"
                sample.capture = None
                self._release_counts(sample)
                self.scheduler.finish(sample)

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running."""
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """Live numbers for monitoring (requests running and waiting, cache use and hits)."""
        sched, blocks = self.scheduler, self.blocks
        return EngineStats(len(sched.running), len(sched.waiting), blocks.usage(), blocks.hit_tokens,
                           blocks.queried_tokens, self.num_generated_tokens)

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
            if value is not None and value > self.config.max_logprobs:
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
        return resolve_steering(params.steering, mc.num_layers, mc.hidden_size, mc.dtype, self.device,
                                self.config.max_steers_per_request, mc.point_shapes(), saes=self.saes)

    def _selection(self, token_ids: list[int], params: SamplingParams, encode: bool, max_tokens: int) -> Selection:
        """Resolve the request's hidden-state spec and apply the instance policy."""
        if not self.config.enable_hidden_states:
            raise ValueError("hidden_states: this instance was started with enable_hidden_states=False")
        mc, p = self.model_config, len(token_ids)
        end = p if encode else min(p + max_tokens, mc.max_model_len) - 1
        sel = resolve(
            params.hidden_states, num_layers=mc.num_layers, hidden_size=mc.hidden_size, model_dtype=mc.dtype,
            num_prompt=p, max_positions=end, encode=encode, vocab_size=mc.vocab_size,
            point_shapes=mc.point_shapes(),
        )
        if params.hidden_states.sae is not None:  # SAE features: the SAE moves to the device once per engine
            sel.features = resolve_features(params.hidden_states, num_layers=mc.num_layers,
                                            hidden_size=mc.hidden_size, point_shapes=mc.point_shapes(),
                                            saes=self.saes, pseudo_layer=PSEUDO_LAYER)
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

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it.

        A failure that belongs to one request (its sampling, capture, reducer plugin,
        steering, detokenization) finishes that request alone with ``finish_reason="error"``;
        the others in the batch go on as if it had not been there.
        """
        sched = self.scheduler.schedule()
        self.runner.copy_blocks(self.blocks.take_copies())  # copy-on-write of blocks shared by samples
        finished: list[Request] = []
        for req in sched.dropped:  # unreachable while max_model_len fits the cache; kept as a guard
            self._fail(req, f"the request needs {req.num_tokens} tokens of KV cache, more than the cache "
                       f"holds ({self.blocks.num_blocks * self.blocks.block_size})", "invalid_request_error")
            finished.append(req)
        if not sched.items:
            return finished
        now = time.monotonic()
        for it in sched.items:
            if it.request.times.scheduled is None:
                it.request.times.scheduled = now
        result = self._execute_isolated(sched.items)
        for req, failure in result.failed.items():
            self._fail(req, failure.message, failure.error_type)
            finished.append(req)
        for it in sched.items:
            req = it.request
            if req.finished:
                continue
            req.num_computed_tokens += it.num_tokens
            self.blocks.cache_full_blocks(req)
            if req.encode_only and it.samples:
                self._finish(req, "length", None)
                finished.append(req)
        for req in result.sampled:
            if req.parent is not None and req in req.parent.forks:
                self._fork(req)
        now = time.monotonic()
        for req, token in result.sampled.items():
            if req.finished:
                continue
            req.times.on_token(now)
            if self._append_token(req, token):
                finished.append(req)
        # A prompt with several samples is finished when its last sample is.
        done: dict[int, Request] = {}
        for req in finished:
            root = req.parent or req
            if root.group_finished:
                done[id(root)] = root
        return list(done.values())

    def _fork(self, sample: Request) -> None:
        """Start ``sample`` from its prompt's computed blocks (shared) and captured states (copied)."""
        parent = sample.parent
        assert parent is not None
        parent.forks.remove(sample)
        if parent.finish_reason == "error":
            self._fail(sample, parent.error or "the request failed", parent.error_type or "server_error")
            return
        self.blocks.fork(parent, sample)
        sample.num_computed_tokens = parent.num_computed_tokens
        sample.num_cached_tokens = parent.num_cached_tokens
        sample.status = RequestStatus.RUNNING
        self.scheduler.running.append(sample)
        if parent.capture is not None:
            try:  # a reducer plugin's state is copied here
                sample.capture = parent.capture.fork()
            except Exception as exc:  # noqa: BLE001 - belongs to this sample alone
                self._fail(sample, f"hidden_states: copying the capture for sample {sample.sample_index} failed: "
                           f"{type(exc).__name__}: {exc}", "server_error")

    def _execute_isolated(self, items: list[ScheduledItem]) -> StepResult:
        """Run ``items``; if the batch raises, rerun halves until the failing request is alone.

        Nothing a step commits (KV slots are rewritten with the same values, capture and
        sampling happen after the forward) is done twice, so the other requests' tokens and
        states equal those of an undisturbed step.
        """
        try:
            return self.runner.execute(items)
        except Exception as exc:  # noqa: BLE001 - isolated below
            if len(items) == 1:
                logger.exception("request %s failed in the forward pass", items[0].request.request_id)
                return StepResult(failed={items[0].request: RowFailure(
                    f"the forward pass failed for this request: {type(exc).__name__}: {exc}", "server_error")})
            logger.warning("a step of %d requests failed (%s: %s); rerunning it in halves to isolate the cause",
                           len(items), type(exc).__name__, exc)
        mid = len(items) // 2
        first, second = self._execute_isolated(items[:mid]), self._execute_isolated(items[mid:])
        first.sampled.update(second.sampled)
        first.failed.update(second.failed)
        return first

    def _append_token(self, req: Request, token: int) -> bool:
        req.token_ids.append(token)
        self.num_generated_tokens += 1
        p = req.params
        try:
            delta = req.detokenizer.step(token)
        except Exception as exc:  # noqa: BLE001 - belongs to this request alone
            self._fail(req, f"detokenizing token {token} failed: {type(exc).__name__}: {exc}", "server_error")
            return True
        if req.grammar is not None and (refused := req.grammar.accept(token)) is not None:
            self._fail(req, refused, "server_error")
            return True
        # As in vLLM, nothing stops a request before min_tokens (its sampler bans EOS and stop ids too).
        may_stop = len(req.output_token_ids) >= p.min_tokens
        if delta:
            prev = len(req.text)
            req.text += delta
            if p.stop_strings and may_stop and self._check_stop_strings(req, prev):
                return True
        if may_stop and ((not p.ignore_eos and token in self.model_config.eos_token_ids)
                         or token in p.stop_token_ids):
            self._finish(req, "stop", token)
            return True
        if req.grammar is not None and req.grammar.terminated:  # the output is complete: nothing can follow
            self._finish(req, "stop", None)
            return True
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.model_config.max_model_len:
            self._finish(req, "length", None)
            return True
        return False

    def _check_stop_strings(self, req: Request, prev_len: int) -> bool:
        longest = max(len(s) for s in req.params.stop_strings)
        begin = max(0, prev_len - longest + 1)
        hits = [(req.text.find(s, begin), s) for s in req.params.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        idx, s = min(hits)
        req.text = req.text[:idx]
        self._finish(req, "stop", s)
        return True

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        req.times.finished = time.monotonic()
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.scheduler.finish(req)
        self._release_counts(req)
        if req.group_finished:
            root = req.parent or req
            self.requests.pop(root.request_id, None)
        if req.capture is not None and reason != "error":
            try:  # reducers finish here, so a plugin that raises fails this request alone
                req.hidden_states = req.capture.result()
            except Exception as exc:  # noqa: BLE001
                self._set_error(req, f"hidden_states: finishing the capture failed: {type(exc).__name__}: {exc}",
                                "server_error")
            req.capture = None  # its buffers are in the result now (or gone with the error)
        if req.prompt_lp is not None and reason != "error":
            req.prompt_logprobs = req.prompt_lp.result()
        req.prompt_lp = None

    def _fail(self, req: Request, message: str, error_type: str) -> None:
        """Finish ``req`` alone with an error; its blocks and buffers are released."""
        logger.warning("request %s failed: %s", req.request_id, message)
        self._set_error(req, message, error_type)
        req.capture = None
        if req.parent is not None and req in req.parent.forks:
            req.parent.forks.remove(req)
        forks, req.forks = req.forks, []
        for sample in forks:  # samples that never started share the prompt's fate
            self._set_error(sample, message, error_type)
            self._finish(sample, "error", None)
        self._finish(req, "error", None)

    def _release_counts(self, req: Request) -> None:
        if req.counts_slot >= 0:
            self.runner.token_counts.release(req.counts_slot)
            req.counts_slot = -1

    @staticmethod
    def _set_error(req: Request, message: str, error_type: str) -> None:
        req.error, req.error_type = message, error_type
        req.finish_reason = "error"
        req.hidden_states = None

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


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed``: ``seed`` itself for sample 0 (so
    ``n=1`` is unchanged), else a hash of both (deterministic, independent of the batch)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine for monitoring (``LLMEngine.stats``)."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of blocks referenced by requests
    prefix_cache_hit_tokens: int  # prompt tokens served from the prefix cache, since start
    prefix_cache_queried_tokens: int  # prompt tokens looked up in it, since start
    generated_tokens: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens that came from the cache (0 before any lookup)."""
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0
