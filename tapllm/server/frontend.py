"""What an API server process holds of the engine: its configuration, tokenizer and input processor.

With the engine core in a process of its own, the API server still tokenizes, renders chat
templates, refuses what the engine could not serve and resolves the rest, before anything
crosses to the core: each request is prepared here, once, by the engine's own
``InputProcessor`` over the core's ``ModelConfig`` (as capped to the KV cache) and the shapes of
the model's points, both sent by the core when it is ready. The core receives the prepared
``EngineCoreRequest``; nothing of the model's weights is loaded here.
"""

from __future__ import annotations

from tapllm.config import EngineConfig, ModelConfig
from tapllm.engine.input_processor import InputProcessor
from tapllm.engine.chat import load_chat_template
from tapllm.engine.tokenizer import load_tokenizer


class EngineFrontend:
    """The engine as the routes and admission see it (configs, ``tokenizer``, ``input_processor``), without a model."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, point_shapes: dict[str, tuple[int, ...]],
                 context_limited_by_cache: bool) -> None:
        self.config = config
        self.model_config = model_config
        self.quantization = config.quantization_label()
        self.tokenizer = load_tokenizer(model_config.tokenizer_path or model_config.path)
        if config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        self.input_processor = InputProcessor(model_config, config, self.tokenizer, point_shapes,
                                              context_limited_by_cache)
        self.input_processor.grammars.warm_in_background()
