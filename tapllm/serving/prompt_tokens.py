"""The prompt tokens a front end routes a request by, read from its raw HTTP body.

The router (``tapllm.server.router.PrefixRouter``) picks a replica by the chained hashes of
the prompt's full KV blocks, so the front needs the prompt's token ids before any replica sees
the request. They are computed as a replica computes them: a text prompt is encoded with the
model's tokenizer (``add_special_tokens`` as the body asks, default as the server's), a
chat's messages are rendered with the chat template first; token-id prompts are taken as they
are; of several prompts in one body, the first decides.

This is routing only: a body the front cannot read (malformed, an unknown shape, a refused
template) yields no tokens, so it goes to the least busy replica, whose app answers it with
the same error ``tapllm serve`` would.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from typing import Any

from tapllm.engine.chat import render_chat
from tapllm.server.bodies import parse_body
from tapllm.server.errors import APIError
from tapllm.server.schema import ChatCompletionRequest

# path -> the body field holding the prompt(s), for the routes that take plain prompts
PROMPT_FIELDS = {"/v1/completions": "prompt", "/v1/hidden_states": "input", "/v1/embeddings": "input"}
CHAT_PATHS = ("/v1/chat/completions",)


class PromptTokens:
    """Computes the routing tokens of request bodies with the model's tokenizer (and chat template)."""

    def __init__(self, tokenizer: Any, max_body_tokens: int) -> None:
        if max_body_tokens < 1:
            raise ValueError(f"max_body_tokens must be >= 1, got {max_body_tokens}")
        self.tokenizer = tokenizer
        self.max_body_tokens = max_body_tokens  # more than a replica would run: the prefix decides anyway

    def of(self, path: str, raw: bytes) -> list[int]:
        """The prompt tokens of a ``POST path`` body ``raw``; ``[]`` when it has none we can read."""
        try:
            if path in CHAT_PATHS:
                return self._chat(raw)
            field = PROMPT_FIELDS.get(path)
            if field is None:
                return []
            body = json.loads(raw)
            if not isinstance(body, dict):
                return []
            return self._prompt(body.get(field), bool(body.get("add_special_tokens", True)))
        except (APIError, ValueError, TypeError, RecursionError, UnicodeDecodeError):
            return []

    def _chat(self, raw: bytes) -> list[int]:
        body = parse_body(raw, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
                    for m in body.messages]
        text = render_chat(self.tokenizer, messages, body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           chat_template_kwargs=body.chat_template_kwargs)
        return self._encode(text, body.add_special_tokens)

    def _prompt(self, prompt: Any, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # several prompts: the first decides
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [operator.index(t) for t in prompt[: self.max_body_tokens]]
        return []

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        encode: Callable[..., list[int]] = self.tokenizer.encode
        return list(encode(text, add_special_tokens=add_special_tokens))[: self.max_body_tokens]
