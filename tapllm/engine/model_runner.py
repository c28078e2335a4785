"""Owns the model and its KV cache; turns a scheduled step into batch tensors, runs it, samples."""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass, field

import torch

from tapllm.backends import Backend, select_backend
from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.logits_processors import TokenCounts
from tapllm.engine.request import Request
from tapllm.engine.sampler import RowFailure
from tapllm.engine.scheduler import ScheduledItem
from tapllm.engine.block_tables import BlockTables
from tapllm.engine.cuda_graphs import GraphRunner
from tapllm.engine.graph_tap import NO_TAP, TapShape, tap_shape
from tapllm.engine.staging import Download, Staging
from tapllm.engine.step_inputs import StepLayout, lay_out, upload, upload_graph_step
from tapllm.engine.step_tap import StepTap
from tapllm.hidden_states.sink import CopySink
from tapllm.layers.linear import Linear
from tapllm.loader.gguf_blocks import gguf_source, keep_gguf_blocks
from tapllm.loader.dummy import fill_dummy_weights
from tapllm.loader.weights import iter_weights
from tapllm.models import build_model
from tapllm.models.shapes import point_shapes
from tapllm.quant.embedding import quantize_embedding
from tapllm.quant.linear import quantize_linears
from tapllm.structured.masks import MaskComputer
from tapllm.tap.points import HIDDEN_POINTS
from tapllm.utils.platform import available_memory_bytes, cpu_support, trim_heap, tune_cpu_allocator

logger = logging.getLogger("tapllm")


DEFAULT_KV_SHARE = 0.2  # of the memory available at start
DEFAULT_KV_MAX_BYTES = 4e9


def default_kv_cache_bytes() -> float:
    """The KV cache budget when none is set: a fifth of the memory available now, at most 4 GB
    (2 GB where the available memory cannot be read)."""
    available = available_memory_bytes()
    return 2e9 if available is None else min(DEFAULT_KV_SHARE * available, DEFAULT_KV_MAX_BYTES)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, commit: bool = False) -> torch.Tensor:
    """A zero-filled cache tensor; on CPU its pages become resident only when first written,
    unless ``commit``: then they are written now (``kv_cache_precommit``).

    The cache must start as zeros (masked slots are multiplied by zero probabilities, and
    garbage could be NaN). An anonymous ``mmap`` gives untouched zero pages, so a large cache
    costs memory only as far as requests fill it (``torch.zeros`` would write, and so commit,
    the whole size up front). Transparent huge pages are refused for it: a cache is touched a
    4 KiB block here and there, and with 2 MiB pages (what numpy's ``zeros`` asks for) the
    first prefill of a batch of 16 committed 440 MB instead of 205 MB.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps ``buffer`` alive for as long as the tensor lives.
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    if commit:
        # Writing faults the pages in on every torch thread (MAP_POPULATE faults on one).
        flat.zero_()
    return flat.view(dtype).view(shape)


def _linear_path(device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cpu":
        return "F.linear"
    support = cpu_support()
    if dtype in support.packable:
        return "prepacked for oneDNN"
    return f"plain F.linear ({support.reason or 'no oneDNN packing for ' + str(dtype)})"


@dataclass(slots=True)
class StepResult:
    """What a step produced: a token per sampling request, and requests that failed alone."""

    sampled: dict[Request, int] = field(default_factory=dict)
    failed: dict[Request, RowFailure] = field(default_factory=dict)


class ModelRunner:
    """Loads weights, allocates the paged KV cache and executes steps."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device) -> None:
        self.mcfg = model_config
        self.ecfg = engine_config
        self.device = device
        if device.type == "cpu":
            tune_cpu_allocator()
        t0 = time.perf_counter()
        with torch.device(device):
            self.model = build_model(model_config)
        self.quant = engine_config.quant()
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
        self.model.prepare_for_inference(device)
        if device.type == "cpu":
            trim_heap()  # the load's freed temporaries leave the resident set
        self.model.eval()
        self.backend: Backend = select_backend(device, model_config.dtype, enforce_eager=engine_config.enforce_eager,
                                               graph_sizes=engine_config.graph_sizes(device))
        self.model.use_backend(self.backend)
        logger.info(
            "loaded %s (%s, %s) in %.1fs; linear layers: %s",
            model_config.architecture, model_config.path.name, model_config.dtype, time.perf_counter() - t0,
            _linear_path(device, model_config.dtype) if self.quant is None else self.quant.describe(),
        )
        logger.info("%s", self.backend.describe())
        # Off CPU, captured rows go to the host in one pinned, asynchronous copy per step.
        self.capture_sink = CopySink(staged=device.type != "cpu")
        self.token_counts = TokenCounts(model_config.vocab_size, device=device)  # penalty state of samples that need it
        self.staging = Staging(device)  # the step's inputs: one upload
        self.download = Download(device)  # the step's results: one download
        self.token_masks = MaskComputer()  # structured output
        self.num_blocks = self._num_blocks()
        # One more block than requests get: the padding rows of a CUDA graph's batch write there.
        self.trash_block = self.num_blocks
        width = min(-(-model_config.max_model_len // engine_config.block_size), self.num_blocks)
        self.block_tables = BlockTables(engine_config.max_num_seqs, width, engine_config.block_size, device,
                                        pad_block=self.trash_block)
        shape = (model_config.num_kv_heads, self.num_blocks + 1, engine_config.block_size, model_config.head_dim)
        self.kv_caches = [
            (_zeros(shape, model_config.dtype, device, engine_config.kv_cache_precommit),
             _zeros(shape, model_config.dtype, device, engine_config.kv_cache_precommit))
            for _ in range(model_config.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GB, %s)",
            self.num_blocks, engine_config.block_size,
            self.num_blocks * engine_config.block_size * model_config.kv_bytes_per_token / 1e9,
            "committed at start" if engine_config.kv_cache_precommit else "committed as written",
        )
        self.graphs: GraphRunner | None = None
        if self.backend.graph_sizes:
            if self.model.needs_prompt_lengths:
                logger.info("CUDA graphs off: %s reads each row's prompt length", model_config.architecture)
            else:
                self.use_graphs(self.backend.graph_sizes, capture=True)

    @torch.inference_mode()
    def use_graphs(self, sizes: tuple[int, ...], capture: bool = True) -> GraphRunner:
        """Replay decode steps of up to ``max(sizes)`` rows from graphs (captured now for the plain
        step); ``capture=False`` runs the same code without a graph (CPU, tests)."""
        bs = self.ecfg.block_size
        self.graphs = GraphRunner(self.model, self.kv_caches, self.block_tables, sizes, self.backend.attention,
                                  {**{p: (self.mcfg.hidden_size,) for p in HIDDEN_POINTS}, **point_shapes(self.model)},
                                  self.mcfg.dtype, self.device, self.trash_block * bs,
                                  capture=capture)
        if capture:
            before = torch.cuda.memory_allocated(self.device)
            self.graphs.capture_plain()
            logger.info("CUDA graphs: %d batch sizes (%s) captured in %.1fs, %.2f GB",
                        len(sizes), ", ".join(map(str, sizes)), self.graphs.capture_seconds,
                        (torch.cuda.memory_allocated(self.device) - before) / 1e9)
        return self.graphs

    def describe(self) -> str:
        """The lines of :meth:`tapllm.LLM.describe`."""
        mc, ec = self.mcfg, self.ecfg
        linear = _linear_path(self.device, mc.dtype) if self.quant is None else self.quant.describe()
        return "\n".join([
            f"model: {mc.architecture} ({mc.path.name}), {mc.num_layers} blocks, hidden {mc.hidden_size}, {mc.dtype}",
            self.backend.describe(),
            f"linear layers: {linear}",
            f"KV cache: {self.num_blocks} blocks of {ec.block_size} tokens "
            f"({self.num_blocks * ec.block_size * mc.kv_bytes_per_token / 1e9:.2f} GB) on {self.device}",
        ])

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
        budget = util * total - weights - reserve
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={util} leaves no memory for the KV cache "
                             f"({total / 1e9:.1f} GB device, {weights / 1e9:.1f} GB of weights)")
        return budget

    @torch.inference_mode()
    def execute(self, items: list[ScheduledItem]) -> StepResult:
        """Run one step of ``items``; returns the sampled tokens and the requests that failed alone.

        Raises only for errors that belong to the whole batch (the engine then isolates them).
        """
        items = sorted(items, key=lambda it: it.num_tokens != 1)  # decodes first
        self.capture_sink.pending.clear()  # a previous failed step may have left staged copies
        lay = lay_out(items, self.block_tables)
        tap = StepTap.build(lay.captures, lay.steers, self.device, self.capture_sink)
        # Prompt-only requests need the blocks up to their deepest capture; a step of only such
        # requests stops there (their blocks are salted by that depth: see InputProcessor.prepare).
        depths = [it.request.depth for it in items]
        depth = None if None in depths else max(depths)
        shape = self._graph_shape(lay, tap, depth)
        logits = hidden = None
        if shape is not None:
            batch = upload_graph_step(lay, self.staging, self.block_tables, self.graphs.inputs_for(len(lay.ids)),
                                      self.graphs.trash_slot, vocab_size=self.mcfg.vocab_size, device=self.device)
        else:
            batch = upload(lay, self.staging, self.block_tables, attn=self.backend.attention,
                           prompt_lengths=self.model.needs_prompt_lengths, vocab_size=self.mcfg.vocab_size,
                           device=self.device)
        # Grammar masks of this step's constrained rows are computed while the forward runs.
        pending_mask = self.token_masks.submit(
            [(i, req.grammar) for i, (_, req) in enumerate(batch.sample_rows) if req.grammar is not None],
            self.mcfg.vocab_size)
        if shape is not None:
            logits = self.graphs.run(shape, len(lay.ids), tap.steering if tap is not None else None,
                                     tap.capture if tap is not None else None)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, tap, num_layers=depth)
        result = StepResult()
        if tap is not None:
            owner = {it.request.capture: it.request for it in items if it.request.capture is not None}
            for capture, message in tap.finish().items():
                result.failed[owner[capture]] = RowFailure(message, "server_error")
        for it, row in batch.prompt_logprob_rows:
            req = it.request
            window = req.prompt_lp.window(it.start, it.num_tokens)
            if window is None or req in result.failed:
                continue
            a, b = window
            try:
                req.prompt_lp.consume(hidden[row + a - it.start : row + b - it.start], a, b, self.model.compute_logits)
            except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                result.failed[req] = RowFailure(f"prompt_logprobs failed: {type(exc).__name__}: {exc}",
                                                "server_error")
        plan = batch.sampling
        if plan is None:
            return result
        if logits is None:
            if batch.sample_index is not None:  # all rows sample in a pure decode step: no gather
                hidden = hidden.index_select(0, batch.sample_index)
            logits = self.model.compute_logits(hidden)
        elif batch.sample_index is not None:  # a graph's padded rows, or forks sharing a row
            logits = logits.index_select(0, batch.sample_index)
        mask = pending_mask.result() if pending_mask else None
        results = plan.sample(logits, self.token_counts, mask)
        failures = {row: RowFailure(message, "server_error") for row, message in (mask.errors if mask else {}).items()}
        tokens = plan.read(self.download.fetch(results), failures)
        for row, (req, token) in enumerate(zip(plan.requests, tokens)):
            if row in failures:
                result.failed.setdefault(req, failures[row])
            elif req not in result.failed:
                result.sampled[req] = token
        return result

    def _graph_shape(self, lay: StepLayout, tap: StepTap | None, depth: int | None) -> TapShape | None:
        """The tap shape of the graph this step replays, or None (and the reason counted) for an eager step."""
        graphs = self.graphs
        if graphs is None:
            return None
        reason = None
        if not lay.decode_only:
            reason = "a prefill chunk in the step"
        elif len(lay.ids) > graphs.max_size:
            reason = f"more than {graphs.max_size} rows"
        elif lay.prompt_logprob_rows:
            reason = "prompt logprobs"
        elif depth is not None:
            reason = "prompt-only requests stop early"
        else:
            shape, reason = tap_shape(tap.capture, tap.steering) if tap is not None else (NO_TAP, None)
            if reason is None:
                return shape
        graphs.fall_back(reason)
        return None

    def release(self, req: Request) -> None:
        """Forget a request that finished or was aborted (its block-table row is free again)."""
        self.block_tables.release(req)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``(source, destination)`` in every layer (copy-on-write after a fork)."""
        if not copies:
            return
        src = torch.tensor([a for a, _ in copies], device=self.device)
        dst = torch.tensor([b for _, b in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(1, dst, k.index_select(1, src))
            v.index_copy_(1, dst, v.index_select(1, src))

