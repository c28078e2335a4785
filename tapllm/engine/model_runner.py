"""Owns the model and its KV cache; turns a scheduled step into batch tensors, runs it, samples."""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass, field

import torch

from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.logits_processors import TokenCounts
from tapllm.engine.request import Request
from tapllm.engine.sampler import RowFailure, sample
from tapllm.engine.scheduler import ScheduledItem
from tapllm.engine.step_tap import CaptureSpan, StepTap, SteerSpan
from tapllm.hidden_states.sink import CopySink
from tapllm.kernels import fused_kernels
from tapllm.layers.attention import AttentionMetadata, PrefillBatch, PrefillChunk, group_prefills
from tapllm.layers.linear import Linear
from tapllm.loader.gguf_blocks import gguf_source, keep_gguf_blocks
from tapllm.loader.weights import iter_weights
from tapllm.models import build_model
from tapllm.quant.embedding import quantize_embedding
from tapllm.quant.linear import quantize_linears
from tapllm.structured.masks import MaskComputer
from tapllm.tap import RowSpan
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
class StepBatch:
    """One step's batch tensors, attention metadata, the rows that sample, and the tap's row spans."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[tuple[int, Request]]  # (batch row, request) of each request that samples
    captures: list[CaptureSpan]  # chunks of requests that capture
    steers: list[SteerSpan]  # chunks of requests that steer
    prompt_logprob_rows: list[tuple[ScheduledItem, int]]  # chunks (and first rows) of prompt-logprob requests


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
        weights = iter_weights(model_config.path, group=1 if self.quant is not None else None)
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
        self.model.load_weights(weights)
        self.model.prepare_for_inference(device)
        if device.type == "cpu":
            trim_heap()  # the load's freed temporaries leave the resident set
        self.model.eval()
        self.kernels = None if engine_config.enforce_eager or device.type != "cpu" else fused_kernels()
        self.model.use_kernels(self.kernels)
        logger.info(
            "loaded %s (%s, %s) in %.1fs; linear layers: %s",
            model_config.architecture, model_config.path.name, model_config.dtype, time.perf_counter() - t0,
            _linear_path(device, model_config.dtype) if self.quant is None else self.quant.describe(),
        )
        # Off CPU, captured rows go to the host in one pinned, asynchronous copy per step.
        self.capture_sink = CopySink(staged=device.type != "cpu")
        self.token_counts = TokenCounts(model_config.vocab_size)  # penalty state of the samples that need it
        self.token_masks = MaskComputer()  # structured output
        self.num_blocks = self._num_blocks()
        shape = (model_config.num_kv_heads, self.num_blocks, engine_config.block_size, model_config.head_dim)
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
        batch = self._prepare(items)
        tap = StepTap.build(batch.captures, batch.steers, self.device, self.capture_sink)
        # Grammar masks of this step's constrained rows are computed while the forward runs.
        pending_mask = self.token_masks.submit(
            [(i, req.grammar) for i, (_, req) in enumerate(batch.sample_rows) if req.grammar is not None],
            self.mcfg.vocab_size)
        # Prompt-only requests need the blocks up to their deepest capture; a step of only such
        # requests stops there (their blocks are salted by that depth: see InputProcessor.prepare).
        depths = [it.request.depth for it in items]
        depth = None if None in depths else max(depths)
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
        sample_rows = batch.sample_rows
        if not sample_rows:
            return result
        rows, reqs = zip(*sample_rows)
        if rows != tuple(range(hidden.shape[0])):  # all rows sample in a pure decode step: no gather
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        tokens, failures = sample(logits.cpu(), list(reqs), self.token_counts,
                                  pending_mask.result() if pending_mask else None)
        for row, (req, token) in enumerate(zip(reqs, tokens)):
            if row in failures:
                result.failed.setdefault(req, failures[row])
            elif req not in result.failed:
                result.sampled[req] = token
        return result

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

    def _prepare(self, items: list[ScheduledItem]) -> StepBatch:
        bs = self.ecfg.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, Request]] = []
        prefills: list[PrefillChunk] = []
        prefill_tables: list[list[int]] = []  # every chunk's blocks (the fused attention reads them all)
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        captures: list[CaptureSpan] = []
        steers: list[SteerSpan] = []
        prompt_lp_rows: list[tuple[ScheduledItem, int]] = []
        for it in items:
            req, start, n = it.request, it.start, it.num_tokens
            row = len(ids)
            ids.extend(req.token_ids[start : start + n])
            table = req.block_table
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if n == 1:
                decode_tables.append(table[: (start // bs) + 1])
                decode_lens.append(start + 1)
            else:
                # With cached context, attention reads context and chunk back from the blocks.
                used = torch.tensor(table[: -(-(start + n) // bs)], device=self.device) if start else None
                prefills.append(PrefillChunk(row, n, start, used))
                prefill_tables.append(table[: -(-(start + n) // bs)])
            if it.samples and not req.encode_only:
                sample_rows.append((row + n - 1, req))
                # Samples waiting for this prompt draw their first tokens from the same logits.
                sample_rows.extend((row + n - 1, child) for child in req.forks)
            if req.capture is not None:
                captures.append((RowSpan(row, start, n), req.capture, req.block_table))
            if req.steering is not None:
                steers.append((RowSpan(row, start, n), req.steering))
            if req.prompt_lp is not None:
                prompt_lp_rows.append((it, row))
        dev = self.device
        decode_bt = decode_mask = lens = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            decode_bt = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            if self.kernels is None:  # the fused decode kernel reads only each row's own length
                decode_mask = (torch.arange(width * bs, device=dev)[None, :] >= lens[:, None])[:, None, :]
        prefill_batch = None
        if self.kernels is not None and prefills:  # one fused call attends every chunk
            prefill_batch = PrefillBatch.build(prefills, prefill_tables, dev)
            groups, alone = [], prefills
        else:
            groups, alone = group_prefills(prefills, dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            num_decodes=len(decode_tables),
            decode_block_tables=decode_bt,
            decode_mask=decode_mask,
            prefills=alone,
            prefill_groups=groups,
            decode_lens=lens,
            prompt_lens=torch.tensor([it.request.num_prompt_tokens for it in items for _ in range(it.num_tokens)],
                                     device=dev) if self.model.needs_prompt_lengths else None,
            kernels=self.kernels,
            prefill_batch=prefill_batch,
        )
        return StepBatch(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, sample_rows, captures,
                         steers, prompt_lp_rows)
