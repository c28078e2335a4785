"""What an API server process holds of the engine: its configuration, tokenizer and admission.

With the engine core in a process of its own, the API server still tokenizes, renders chat
templates and refuses what the engine could not serve, before anything crosses to the core.
It does so with the engine's own ``InputProcessor`` over the core's ``ModelConfig`` (as capped
to the KV cache) and the shapes of the model's points, both sent by the core when it is
ready; nothing of the model's weights is loaded here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.input_processor import InputProcessor
from tapllm.engine.request import Request
from tapllm.sampling_params import SamplingParams
from tapllm.engine.tokenizer import load_chat_template, load_tokenizer


def _no_salt(num_prompt: int) -> bytes:
    """The prefix-cache salt is the core's to compute (it prepares each request again)."""
    return b""


class EngineFrontend:
    """The engine as admission sees it (``prepare``, ``render_chat``, ``tokenizer``, configs), without a model."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, point_shapes: dict[str, tuple[int, ...]],
                 context_limited_by_cache: bool) -> None:
        self.config = config
        self.model_config = model_config
        self.quantization = config.quantization_label()
        self.tokenizer = load_tokenizer(model_config.tokenizer_path or model_config.path)
        if config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        # Steers and specs are resolved on the CPU here: only to check them (the core resolves its own).
        self.input_processor = InputProcessor(model_config, config, self.tokenizer, torch.device("cpu"), _no_salt,
                                              point_shapes, context_limited_by_cache)

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams, *, encode: bool = False,
                request_id: str | None = None) -> Request:
        """Tokenize, check and resolve one request, as ``LLMEngine.prepare`` (it is not scheduled here)."""
        return self.input_processor.prepare(prompt, params, encode=encode, request_id=request_id)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None
                    ) -> str:
        """A conversation rendered with the chat template (see ``InputProcessor.render_chat``)."""
        return self.input_processor.render_chat(messages, add_generation_prompt,
                                                continue_final_message=continue_final_message,
                                                chat_template_kwargs=chat_template_kwargs)
