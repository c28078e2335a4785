"""The engine's core: add, step, fork and abort requests over the scheduler and the model runner.

Admission is the input processor's (``engine/input_processor.py``: a prompt becomes an
``EngineCoreRequest``, prepared once); stops, detokenization and outputs are the output
processor's (``engine/output_processor.py``).
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.block_manager import BlockManager
from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.input_processor import InputProcessor
from tapllm.engine.kv_memory import IdleRelease
from tapllm.engine.model_source import resolve_model_config
from tapllm.engine.model_runner import ModelRunner
from tapllm.engine.step_loop import StepLoop
from tapllm.engine.output_processor import OutputProcessor
from tapllm.engine.prompt_logprobs import PromptLogprobs
from tapllm.engine.request import Request, RequestStatus
from tapllm.engine.scheduler import Scheduler
from tapllm.engine.chat import load_chat_template
from tapllm.engine.tokenizer import load_tokenizer
from tapllm.hidden_states.capture import RequestCapture
from tapllm.outputs import RequestOutput
from tapllm.sae.features import DeviceSAEs
from tapllm.structured.compiler import Grammar
from tapllm.utils.collector import paused_collector
from tapllm.utils.platform import bound_onednn_caches, resolve_device

logger = logging.getLogger("tapllm")


class LLMEngine:
    """Runs requests to completion with continuous batching over a paged KV cache.

    The public surface, used by ``LLM``, the server and ``tapllm collect`` alike:
    ``input_processor.prepare`` (tokenize, check and resolve one request into an
    ``EngineCoreRequest``; raises naming the field), :meth:`add` (turn it into a ``Request`` and
    schedule it), :meth:`step`, :meth:`abort`, :meth:`make_output` (the output processor's) and
    :meth:`stats`.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device) -> None:
        engine_config.validate()
        # What exists before the load (the imported modules: torch's are ~170k objects) is frozen
        # first, so the full collection below walks only what the load made.
        gc.freeze()
        self.model_config = model_config
        self.config = engine_config
        self.quantization = engine_config.quantization_label()  # what every result's states were computed with
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
        self.input_processor = InputProcessor(model_config, engine_config, self.tokenizer,
                                              self.runner.point_shapes(), self.context_limited_by_cache)
        self.output_processor = OutputProcessor(self.tokenizer, model_config)
        self.grammars = self.input_processor.grammars  # checks grammars at admission, makes matchers at add
        self.saes = DeviceSAEs(device)  # SAEs of features and SAE steers, on the device
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(engine_config.seed)
        self.requests: dict[str, Request] = {}
        self.num_generated_tokens = 0
        self.last_step_tokens = 0  # tokens the latest step ran (prompt chunks and decodes): a metric
        self.idle = IdleRelease(self.runner, self.blocks, engine_config)
        ahead = engine_config.async_scheduling
        if ahead is None:  # a step ahead where it pays: the device runs steps while the host prepares the next
            ahead = self.runner.graph_step is not None and not self.runner.backend.graphs_emulated
        depth = engine_config.batches_in_flight()
        self.scheduler.in_flight = depth
        self.loop = StepLoop(self, ahead, depth)
        # The loaded model, tokenizer and grammar tables are long-lived: frozen out of the collector's
        # generations, they are no longer walked by every full collection of the step loop.
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        """Stop the model runner's other processes (tensor-parallel ranks), if any; idempotent."""
        self.runner.close()

    def check_alive(self) -> None:
        """Raise ``tapllm.parallel.TensorParallelError`` if a tensor-parallel rank has died or the group is
        broken: such an engine can never step again (a server checks this while idle)."""
        if self.runner.tp is not None:
            self.runner.tp.check_workers()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Resolve ``config``'s model, device and dtype, then load the engine."""
        config.validate()
        bound_onednn_caches()  # CPU matmuls; before anything of the load (the model's config included) reaches oneDNN
        with paused_collector():  # one collection at the end of __init__ instead of several during the load
            device = resolve_device(config.device)
            return cls(resolve_model_config(config, device), config, device)

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

    # ---- output (the output processor's) --------------------------------------------
    def make_output(self, req: Request) -> RequestOutput:
        """The user-facing result of a request (see ``OutputProcessor.make_output``)."""
        return self.output_processor.make_output(req)

    # ---- the core --------------------------------------------------------------------
    def add(self, prepared: EngineCoreRequest) -> Request:
        """Schedule a request prepared by ``input_processor.prepare`` (in this process or an API
        server's); returns the engine's ``Request``, which carries its state and output."""
        if prepared.request_id in self.requests:
            raise ValueError(f"request_id {prepared.request_id!r} is already in flight")
        req = prepared.to_request(self.device, self.saes, self.grammars,
                                  self.runner.model.prompt_salt(prepared.num_prompt_tokens))
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
            req.seed = seed
        req.detokenizer = self.output_processor.detokenizer(req)
        if not req.encode_only:
            req.samples = [self._new_sample(req, i, seed, prepared.grammar) for i in range(1, params.num_samples)]
            req.forks = list(req.samples)
            for sample in req.group:
                if sample.controls is not None and sample.controls.penalized:
                    sample.counts_slot = self.runner.token_counts.acquire(sample.prompt_token_ids)
        if params.prompt_logprobs is not None:
            req.prompt_lp = PromptLogprobs(req.prompt_token_ids, params.prompt_logprobs)
        self.requests[req.request_id] = req
        if req.selection is not None:
            try:  # a reducer plugin's start() runs here
                req.capture = RequestCapture(req.selection, params.hidden_states, self.device,
                                             self.runner.model.lens_logits,
                                             row_exact=self.runner.backend.batch_invariant)
            except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                self._fail(req, f"hidden_states: starting the capture failed: {type(exc).__name__}: {exc}",
                           "server_error")
                return req
        self.scheduler.add(req)
        return req

    def _new_sample(self, req: Request, index: int, seed: int | None, grammar: Grammar | None) -> Request:
        """Sample ``index`` of ``req``'s prompt, waiting to fork from it once the prompt is computed."""
        sample = Request(f"{req.request_id}#{index}", req.arrival, req.prompt, req.prompt_token_ids, req.params,
                         None if seed is None else sample_seed(seed, index),
                         cache_salt=req.cache_salt, status=RequestStatus.WAITING, selection=req.selection,
                         steering=req.steering, max_tokens=req.max_tokens,
                         controls=req.controls, track_cumulative=req.track_cumulative, sample_index=index,
                         parent=req)
        if grammar is not None:  # each sample walks the grammar on its own (compiled once, cached)
            sample.grammar = self.grammars.matcher(grammar)
        sample.detokenizer = self.output_processor.detokenizer(req)
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
                self.runner.release(sample)

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running (or a step's tokens are still to be taken)."""
        return self.scheduler.has_unfinished() or self.loop.busy()

    def stats(self) -> EngineStats:
        """Live numbers for monitoring (requests running and waiting, cache use and hits)."""
        sched, blocks, policy = self.scheduler, self.blocks, self.runner.policy
        return EngineStats(len(sched.running), len(sched.waiting), blocks.usage(), blocks.hit_tokens,
                           blocks.queried_tokens, self.num_generated_tokens, policy.graph_steps,
                           dict(policy.eager_steps))

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it.

        A failure that belongs to one request (its sampling, capture, reducer plugin,
        steering, detokenization) finishes that request alone with ``finish_reason="error"``;
        the others in the batch go on as if it had not been there. With the host a step ahead
        (``async_scheduling``), a step's tokens are taken during the next call (see
        ``engine/step_loop.py``).
        """
        self.idle.busy()
        finished = self.loop.step()
        # A prompt with several samples is finished when its last sample is.
        done: dict[int, Request] = {}
        for req in finished:
            root = req.parent or req
            if root.group_finished:
                done[id(root)] = root
        self.idle.stepped()
        return list(done.values())

    # ---- memory ------------------------------------------------------------------------
    def release_memory(self) -> int:
        """Hand back what an idle engine holds without needing it; the KV cache bytes released
        (see :class:`~tapllm.engine.kv_memory.IdleRelease`). ``RuntimeError`` while requests are in flight."""
        if self.has_unfinished_requests():
            raise RuntimeError("release_memory: requests are in flight")
        return self.idle.release()

    def release_memory_if_idle(self) -> bool:
        """:meth:`release_memory`, once the engine has run nothing for ``release_memory_after_idle_s``
        seconds since its latest step (a server's loop calls this while idle); whether it did."""
        return not self.has_unfinished_requests() and self.idle.release_if_idle()

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
            self.runner.capture_sink.settle()
            try:  # a reducer plugin's state is copied here
                sample.capture = parent.capture.fork()
            except Exception as exc:  # noqa: BLE001 - belongs to this sample alone
                self._fail(sample, f"hidden_states: copying the capture for sample {sample.sample_index} failed: "
                           f"{type(exc).__name__}: {exc}", "server_error")

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        req.times.finished = time.monotonic()
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.scheduler.finish(req)
        self.runner.release(req)
        self._release_counts(req)
        if req.group_finished:
            root = req.parent or req
            self.requests.pop(root.request_id, None)
        if req.capture is not None and reason != "error":
            self.runner.capture_sink.settle()  # its last rows may still be on their way to the host
            try:  # reducers finish here, so a plugin that raises fails this request alone
                req.hidden_states = req.capture.result()
                if self.quantization != "none":  # states of quantized weights say so (saved, sent)
                    req.hidden_states.metadata["quantization"] = self.quantization
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
    graph_steps: int = 0  # steps replayed from a CUDA graph, since start
    graph_fallbacks: dict[str, int] = field(default_factory=dict)  # steps run eagerly with graphs on, by reason

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens that came from the cache (0 before any lookup)."""
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0
