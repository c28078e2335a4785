"""Tokenizer loading, chat templates and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

# Prompt tokens given to the stream decoder as context, so the first generated token's
# leading space (or merge with the prompt's last bytes) decodes as in a full decode.
_CONTEXT_TOKENS = 8


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's Hugging Face fast tokenizer."""
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"model: {path} has no tokenizer.json / tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path))


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
