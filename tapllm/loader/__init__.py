"""Finding, converting and reading checkpoints."""

from tapllm.loader.checkpoint import default_model_path, resolve_model, resolve_tokenizer

__all__ = ["default_model_path", "resolve_model", "resolve_tokenizer"]
