"""The OpenAI-compatible HTTP server: ``tapllm serve``."""

from tapllm.server.app import create_app

__all__ = ["create_app"]
