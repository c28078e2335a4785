"""Owns the model and its KV cache; turns a scheduled step into batch tensors, runs it, samples."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
import torch

from tapllm.backends import Backend, select_backend
from tapllm.backends.policy import StepPolicy, default_graph_sizes
from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.logits_processors import TokenCounts
from tapllm.engine.request import Request
from tapllm.engine.sampler import RowFailure, graph_samples, read_tokens
from tapllm.engine.scheduler import ScheduledItem
from tapllm.engine.block_tables import BlockTables
from tapllm.engine.cuda_graphs import GraphOutputs
from tapllm.engine.graph_memory import graph_step_bytes
from tapllm.engine.graph_step import GraphStep
from tapllm.engine.launched_step import Deliver, LaunchedStep, StepResult
from tapllm.engine.kv_alloc import cache_zeros
from tapllm.engine.pipelined_step import PipelinedStep
from tapllm.engine.staging import Download, Staging
from tapllm.engine.step_inputs import StepBatch, StepLayout, lay_out, upload, upload_graph
from tapllm.engine.step_tap import StepTap
from tapllm.hidden_states.sink import CopySink
from tapllm.layers.linear import Linear
from tapllm.loader.gguf_blocks import gguf_source, keep_gguf_blocks
from tapllm.loader.dummy import fill_dummy_weights
from tapllm.loader.weights import iter_weights
from tapllm.models import build_model
from tapllm.models.shapes import config_point_shapes, point_shapes
from tapllm.parallel import TensorParallel, start_tensor_parallel
from tapllm.quant.embedding import quantize_embedding
from tapllm.quant.linear import quantize_linears
from tapllm.structured.masks import MaskComputer
from tapllm.tap.points import HIDDEN_POINTS
from tapllm.utils.platform import available_memory_bytes, trim_heap, tune_cpu_allocator

logger = logging.getLogger("tapllm")


DEFAULT_KV_SHARE = 0.2  # of the memory available at start
DEFAULT_KV_MAX_BYTES = 4e9


def default_kv_cache_bytes() -> float:
    """The KV cache budget when none is set: a fifth of the memory available now, at most 4 GB
    (2 GB where the available memory cannot be read)."""
    available = available_memory_bytes()
    return 2e9 if available is None else min(DEFAULT_KV_SHARE * available, DEFAULT_KV_MAX_BYTES)


class ModelRunner:
    """Loads weights, allocates the paged KV cache and executes steps."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device) -> None:
        self.mcfg = model_config
        self.ecfg = engine_config
        self.device = device
        if device.type == "cpu":
            tune_cpu_allocator()
        t0 = time.perf_counter()
        self.quant = engine_config.quant()
        self.tp: TensorParallel | None = None  # the other ranks, with tensor or pipeline parallelism
        if engine_config.tensor_parallel_size * engine_config.pipeline_parallel_size > 1:  # this is rank 0
            self.tp, self.model, self.backend = start_tensor_parallel(model_config, engine_config, device)
        else:
            self._load(model_config, engine_config, device)
        logger.info(
            "loaded %s (%s, %s) in %.1fs; linear layers: %s",
            model_config.architecture, model_config.path.name, model_config.dtype, time.perf_counter() - t0,
            self.backend.linear_path(model_config.dtype) if self.quant is None else self.quant.describe(),
        )
        logger.info("%s", self.backend.describe())
        if self.tp is not None:
            logger.info("%s", self.tp.describe())
        # Off CPU, captured rows go to the host in one pinned, asynchronous copy per step.
        self.capture_sink = CopySink(staged=device.type != "cpu")
        self.token_counts = TokenCounts(model_config.vocab_size, device=device)  # penalty state of samples that need it
        self.staging = Staging(device)  # the step's inputs: one upload (a graph step's)
        # Pipeline stages: up to pipeline_parallel_size steps in flight, each with its own inputs (async_scheduling=False: one).
        self.pipelined = engine_config.batches_in_flight() > 1
        self.stagings = [self.staging] + [Staging(device) for _ in range(engine_config.pipeline_parallel_size - 1)]
        self.download = Download(device)  # the step's results: one download
        self.token_masks = MaskComputer()  # structured output
        self.num_blocks = self._num_blocks()
        # One more block than requests get: the padding rows of a CUDA graph's batch write there.
        self.padding_block = self.num_blocks
        width = min(-(-model_config.max_model_len // engine_config.block_size), self.num_blocks)
        self.block_tables = BlockTables(engine_config.max_num_seqs, width, engine_config.block_size, device,
                                        padding_block=self.padding_block)
        # Each slot's latest sampled token, on the device: a step laid out before the previous one's tokens
        # reached the host reads its rows' input there (see LLMEngine's host a step ahead).
        self.last_token = torch.zeros(self.block_tables.table.shape[0], dtype=torch.int64, device=device)
        # this rank's KV heads of each block (none where another pipeline stage holds the block)
        heads = [self.tp.kv_heads(i) if self.tp is not None else model_config.num_kv_heads
                 for i in range(model_config.num_layers)]
        self.kv_caches = [tuple(cache_zeros((h, self.num_blocks + 1, engine_config.block_size, model_config.head_dim),
                                       model_config.dtype, device, engine_config.kv_cache_precommit) for _ in "kv")
                          for h in heads]
        if self.tp is not None:
            self.tp.init_cache(self.num_blocks, engine_config.block_size)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GB, %s)",
            self.num_blocks, engine_config.block_size,
            self.num_blocks * engine_config.block_size * model_config.kv_bytes_per_token / 1e9,
            "committed at start" if engine_config.kv_cache_precommit else "committed as written",
        )
        self.graph_step: GraphStep | None = None
        graphs = self.backend.graphs
        off = None
        if graphs is None:
            off = "off" if self.backend.name == "cuda" else f"none on the {self.backend.name} backend"
        elif self.model.needs_prompt_lengths:
            off = f"off: {model_config.architecture} reads each row's prompt length"
        elif self.model.graphs_off:
            off = f"off: {model_config.architecture} {self.model.graphs_off}"
        else:
            self.graph_step = GraphStep(self.model, self.kv_caches, self.block_tables, graphs, self.backend.attention,
                                        {**{p: (model_config.hidden_size,) for p in HIDDEN_POINTS},
                                         **point_shapes(self.model)}, model_config.num_layers, model_config.dtype,
                                        model_config.vocab_size, self.last_token, device,
                                        capture=not self.backend.graphs_emulated)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            with torch.inference_mode():
                self.graph_step.warm_up()
            if device.type == "cuda":
                logger.info("CUDA graphs: %d captured in %.1fs, %.2f GB", len(graphs.keys()),
                            self.graph_step.graphs.capture_seconds,
                            (torch.cuda.memory_allocated(device) - before) / 1e9)
        self.policy = StepPolicy(graphs if self.graph_step is not None else None, off)

    def _load(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device) -> None:
        """Build the whole model on ``device``, read its weights, pick its backend."""
        with torch.device(device):
            self.model = build_model(model_config)
        weights = None if engine_config.load_format == "dummy" else \
            iter_weights(model_config.path, group=1 if self.quant is not None else None)
        if self.quant is not None and self.quant.method == "gguf":  # the file's blocks as stored
            weights = keep_gguf_blocks(self.model, gguf_source(engine_config.model), model_config.path, Linear,
                                       embedding=engine_config.quantize_embedding, quant=self.quant)
        elif self.quant is not None:  # before loading: each checkpoint tensor is quantized as it is read
            self.model.quant = self.quant
            quantize_linears(self.model, self.quant, Linear)
            if engine_config.quantize_embedding:
                quantize_embedding(self.model, self.quant)
        if self.quant is not None and device.type == "cpu":
            trim_heap()  # the replaced float tables (an initialized embedding) leave before the load's peak
        if weights is None:
            fill_dummy_weights(self.model, engine_config.seed)
        else:
            self.model.load_weights(weights)
        ec = engine_config
        sizes = default_graph_sizes(ec.max_num_seqs, ec.max_num_batched_tokens, ec.cuda_graph_sizes,
                                    ec.cuda_graph_token_sizes)
        self.backend: Backend = select_backend(device, model_config.dtype,
                                               enforce_eager=ec.enforce_eager or bool(self.model.eager_only),
                                               backend=ec.backend,
                                               graphs=sizes if sizes.decode or sizes.mixed else None,
                                               batch_invariant=ec.batch_invariant)
        if self.model.eager_only and not ec.enforce_eager:  # the family's reason, not the user's option
            why = f"{model_config.architecture}: {self.model.eager_only}, so the plain PyTorch step"
            logger.info("%s", why)
            self.backend = replace(self.backend, notes=(why,))
        self.model.prepare_for_inference(self.backend.prepack and self.quant is None, self.backend.pack_rows)
        if device.type == "cpu":
            trim_heap()  # the load's freed temporaries leave the resident set
        self.model.eval()
        self.model.use_backend(self.backend)

    def _kv_per_rank(self) -> str:
        """Each tensor-parallel rank's KV cache in GB: one figure where every rank holds the same."""
        held = self.tp.kv_bytes(self.num_blocks + 1, self.ecfg.block_size)
        return " + ".join(f"{b / 1e9:.3f}" for b in (held[:1] if len(set(held)) == 1 else held))

    def describe(self) -> str:
        """The lines of :meth:`tapllm.LLM.describe`."""
        mc, ec = self.mcfg, self.ecfg
        linear = self.backend.linear_path(mc.dtype) if self.quant is None else self.quant.describe()
        graphs = self.backend.describe_graphs() if self.graph_step is not None else (self.policy.off or "off")
        backend = self.backend.describe().replace(f"CUDA graphs: {self.backend.describe_graphs()}",
                                                  f"CUDA graphs: {graphs}")
        if self.backend.stack is not None and self.model.stack is None:  # not the runner's blocks, or ranks on gloo
            gloo = self.tp is not None and self.tp.group.transport.startswith("gloo")
            why = "the ranks meet over gloo" if gloo else f"not {mc.architecture}'s blocks"
            backend = backend.replace("untapped decode blocks: one C++ call per run of blocks",
                                      f"untapped decode blocks: Python ({why})")
        return "\n".join([
            f"model: {mc.architecture} ({mc.path.name}), {mc.num_layers} blocks, hidden {mc.hidden_size}, {mc.dtype}",
            backend,
            f"linear layers: {linear}",
            f"KV cache: {self.num_blocks} blocks of {ec.block_size} tokens "
            f"({self.num_blocks * ec.block_size * mc.kv_bytes_per_token / 1e9:.2f} GB"
            f"{f'; {self._kv_per_rank()} GB per rank' if self.tp else ''})"
            f" on {self.device}",
            *([self.tp.describe()] if self.tp is not None else []),
        ])

    def point_shapes(self) -> dict[str, tuple[int, ...]]:
        """One position's row shape per head and neuron point of the whole model (every rank's part together)."""
        return config_point_shapes(self.mcfg) if self.tp is not None else point_shapes(self.model)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        if self.tp is not None:
            self.tp.close()

    def _num_blocks(self) -> int:
        bs = self.ecfg.block_size
        if self.ecfg.kv_cache_blocks is not None:
            return self.ecfg.kv_cache_blocks
        by_memory = int(self._kv_cache_bytes() // (self.mcfg.kv_bytes_per_token * bs))
        # No point in more than every sequence at full length could use.
        by_need = self.ecfg.max_num_seqs * -(-self.mcfg.max_model_len // bs)
        return max(1, min(by_memory, by_need))

    def _kv_cache_bytes(self) -> float:
        """The KV cache's memory: ``kv_cache_memory_gb``; else on CUDA with ``gpu_memory_utilization``
        what that share of the device (0.9 unless set) leaves after the weights and an activation
        reserve; on CPU the default budget (:func:`default_kv_cache_bytes`)."""
        util = self.ecfg.gpu_memory_utilization
        if self.ecfg.kv_cache_memory_gb is not None:
            return self.ecfg.kv_cache_memory_gb * 1e9
        if self.device.type != "cuda":
            return default_kv_cache_bytes()
        if util is None:
            util = 0.9  # vLLM's default share of the device
        total = torch.cuda.get_device_properties(self.device).total_memory
        weights = torch.cuda.memory_allocated(self.device)
        # Activations of the largest step: a generous multiple of the step's hidden rows and logits.
        mc = self.mcfg
        act_bytes = torch.tensor([], dtype=mc.dtype).element_size()
        reserve = self.ecfg.max_num_batched_tokens * (16 * mc.hidden_size + mc.vocab_size) * act_bytes
        if self.backend.graphs is not None:  # what the graph step keeps besides its activations
            reserve += graph_step_bytes(self.backend.graphs, mc.hidden_size, mc.vocab_size,
                                        self.ecfg.max_num_seqs + 1, act_bytes, mc.num_layers)
        budget = util * total - weights - reserve
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={util} leaves no memory for the KV cache "
                             f"({total / 1e9:.1f} GB device, {weights / 1e9:.1f} GB of weights)")
        return budget

    def execute(self, items: list[ScheduledItem]) -> StepResult:
        """Run one step of ``items`` to the end; returns the sampled tokens and the requests that failed alone.

        Raises only for errors that belong to the whole batch (the engine then isolates them).
        """
        step = self.launch(items)
        step.deliver()
        return step.result()

    @torch.inference_mode()
    def launch(self, items: list[ScheduledItem]) -> LaunchedStep:
        """Queue one step of ``items`` on the device (see ``engine/launched_step.py``).

        The step is laid out on the host, the decider (:class:`~tapllm.backends.policy.StepPolicy`)
        picks a graph or the eager step, its inputs go up in one upload, the forward and the sampling
        are queued, and the tokens start on their way back; prompt logprobs are taken now.

        Laying the step out counts its requests' block-table entries and slot tables as sent; a launch
        that raises may have failed before its upload carried them, so its requests send theirs anew.
        """
        try:
            return self._launch(items)
        except BaseException:
            for it in items:
                self.block_tables.resend(it.request)
                if self.graph_step is not None:
                    self.graph_step.release(it.request)
            raise

    def _launch(self, items: list[ScheduledItem]) -> LaunchedStep:
        items = sorted(items, key=lambda it: it.num_tokens != 1)  # decodes first
        self.capture_sink.pending.clear()  # a previous failed step may have left staged copies
        lay = lay_out(items, self.block_tables)
        key = None
        if self.graph_step is not None:
            key, _ = self.policy.choose(self.graph_step.shape(lay))
        if key is not None:
            gs = self.graph_step
            # The graph's sampler takes every row unless one needs the plan (logprobs, controls, a grammar) or
            # a row samples for several requests (forks of a prompt); then the plan samples the graph's logits.
            own = all(graph_samples(req) for _, req in lay.sample_rows) and \
                len({r for r, _ in lay.sample_rows}) == len(lay.sample_rows)
            batch, inputs = upload_graph(lay, self.staging, self.block_tables, lambda host: gs.fill(lay, key, host),
                                         gs.inputs.size, vocab_size=self.mcfg.vocab_size, device=self.device,
                                         rows=len(lay.ids) if key.kind == "decode" else None, writes=gs.writes(),
                                         plan=not own)
            pending_mask = self._submit_masks(batch)
            out = gs.run(key, inputs)
            hidden, logits = out.hidden, out.logits

            def deliver(stopped: set[Request]) -> dict:
                return gs.deliver(lay, self.capture_sink, stopped)

            if own:
                return self._graph_sampled(items, batch, out, deliver)
            logits = logits.index_select(0, batch.sample_index) if batch.sample_index is not None else \
                logits[: len(lay.sample_rows)]
        else:
            tap = StepTap.build(*lay.tap_spans(), self.device, self.capture_sink,
                                sae_kernel=self.backend.name == "cuda")
            # Prompt-only requests need the blocks up to their deepest capture; a step of only such
            # requests stops there (their blocks are salted by that depth: see InputProcessor.prepare).
            depths = [it.request.depth for it in items]
            depth = None if None in depths else max(depths)
            self.stagings.append(staging := self.stagings.pop(0))  # one per step in flight
            batch = upload(lay, staging, self.block_tables, attn=self.backend.attention,
                           prompt_lengths=self.model.needs_prompt_lengths, vocab_size=self.mcfg.vocab_size,
                           device=self.device, last_token=self.last_token, invariant=self.backend.batch_invariant)
            pending_mask = self._submit_masks(batch)
            deliver = (lambda stopped: tap.finish()) if tap is not None else None
            if self.pipelined:  # later pipeline stages finish it when its tokens are taken
                rest = self.model.start(batch.input_ids, batch.positions, self.kv_caches, batch.meta, tap, depth)
                return PipelinedStep(items, list(batch.sampling.requests) if batch.sampling is not None else [],
                                     lambda: self._planned(items, batch, rest(), None, deliver, pending_mask))
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, tap, num_layers=depth)
            logits = None
        return self._planned(items, batch, hidden, logits, deliver, pending_mask)

    def _graph_sampled(self, items: list[ScheduledItem], batch: StepBatch, out: GraphOutputs, deliver: Deliver
                       ) -> LaunchedStep:
        """A graph step whose tokens the graph samples (drawing rows too, or, where step graphs cannot
        draw, by a sampler graph)."""
        failed = self._prompt_logprobs(batch, out.hidden)
        requests = [req for _, req in batch.sample_rows]
        if not requests:
            return LaunchedStep(items, [], deliver=deliver, tokens=None, read=None, failed=failed, row_failures={},
                                graph_sampled=True)
        tokens, graphs = out.tokens, self.graph_step.graphs
        if not graphs.draws_in_step and any(not req.params.greedy for req in requests):
            tokens = graphs.draw(len(requests))
        return LaunchedStep(items, requests, deliver=deliver, tokens=self.download.start(tokens[: len(requests)]),
                            read=lambda codes, failures: read_tokens(codes, requests, failures), failed=failed,
                            row_failures={}, graph_sampled=True)

    def _submit_masks(self, batch: StepBatch) -> object:
        """Grammar masks of the step's constrained rows, computed while the forward runs."""
        return self.token_masks.submit(
            [(i, req.grammar) for i, (_, req) in enumerate(batch.sample_rows) if req.grammar is not None],
            self.mcfg.vocab_size)

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor | None) -> dict[Request, RowFailure]:
        """Fold the step's rows into the prompt logprobs of the requests that ask; returns those that failed."""
        failed: dict[Request, RowFailure] = {}
        for it, row in batch.prompt_logprob_rows:
            req = it.request
            window = req.prompt_lp.window(it.start, it.num_tokens)
            if window is None:
                continue
            a, b = window
            try:
                req.prompt_lp.consume(hidden[row + a - it.start : row + b - it.start], a, b, self.model.compute_logits)
            except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                failed[req] = RowFailure(f"prompt_logprobs failed: {type(exc).__name__}: {exc}", "server_error")
        return failed

    def _planned(self, items: list[ScheduledItem], batch: StepBatch, hidden: torch.Tensor | None,
                 logits: torch.Tensor | None, deliver: Deliver | None, pending_mask: object) -> LaunchedStep:
        """A step the sampling plan samples: prompt logprobs, then the samples (their copy started)."""
        failed = self._prompt_logprobs(batch, hidden)
        plan = batch.sampling
        if plan is None:
            return LaunchedStep(items, [], deliver=deliver, tokens=None, read=None, failed=failed, row_failures={},
                                graph_sampled=False)
        if logits is None:
            if batch.sample_index is not None:  # all rows sample in a pure decode step: no gather
                hidden = hidden.index_select(0, batch.sample_index)
            logits = self.model.compute_logits(hidden)
        mask = pending_mask.result() if pending_mask else None
        results = plan.sample(logits, self.token_counts, mask)
        failures = {row: RowFailure(message, "server_error") for row, message in (mask.errors if mask else {}).items()}
        return LaunchedStep(items, plan.requests, deliver=deliver, tokens=self.download.start(results), read=plan.read,
                            failed=failed, row_failures=failures, graph_sampled=False)

    def release(self, req: Request) -> None:
        """Forget a request that finished, was aborted or preempted (its slot is free again)."""
        self.block_tables.release(req)
        if self.graph_step is not None:
            self.graph_step.release(req)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``(source, destination)`` in every layer (copy-on-write after a fork)."""
        if not copies:
            return
        if self.tp is not None:
            self.tp.copy_blocks(copies)
        src = torch.tensor([a for a, _ in copies], device=self.device)
        dst = torch.tensor([b for _, b in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(1, dst, k.index_select(1, src))
            v.index_copy_(1, dst, v.index_select(1, src))

