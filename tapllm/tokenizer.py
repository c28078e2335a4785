"""Tokenizer loading, chat templates and incremental detokenization."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from tapllm._text import check_unicode

# Prompt tokens given to the stream decoder as context, so the first generated token's
# leading space (or merge with the prompt's last bytes) decodes as in a full decode.
_CONTEXT_TOKENS = 8


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's Hugging Face fast tokenizer."""
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"model: {path} has no tokenizer.json / tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path))


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render a conversation with the tokenizer's chat template, after checking every message."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template")
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        check_message(m, f"messages[{i}]")
    try:
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # the template itself may raise (jinja's raise_exception, type errors)
        raise ValueError(f"messages: the chat template refused them: {exc}") from None


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


class IncrementalDetokenizer:
    """Turns tokens into text one at a time, holding back incomplete UTF-8 sequences."""

    __slots__ = ("_backend", "_stream")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend_tokenizer
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The new text that ``token_id`` completes ("" while a character is still partial)."""
        return self._stream.step(self._backend, token_id) or ""
