"""Tokenizer loading and incremental detokenization (chat templates: :mod:`tapllm.engine.chat`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from tapllm.engine.cached_tokenizer import read_tokenizer

# Prompt tokens given to the stream decoder as context, so the first generated token's
# leading space (or merge with the prompt's last bytes) decodes as in a full decode.
_CONTEXT_TOKENS = 8


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer, as transformers resolves it: a :class:`CachedTokenizer` (transformers'
    fast tokenizer without importing transformers, see :mod:`tapllm.engine.cached_tokenizer`), or
    the transformers tokenizer itself where that cannot stand for it."""
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"model: {path} has no tokenizer.json / tokenizer_config.json")
    return read_tokenizer(path)


class IncrementalDetokenizer:
    """Turns tokens into text one at a time, holding back incomplete UTF-8 sequences.

    With ``spaces_between_special_tokens=False`` (and special tokens kept) a special token that
    follows another is written as its bare content, with no space the decoder may put before it.
    """

    __slots__ = ("_backend", "_stream", "_specials", "_last_special")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._specials: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._specials = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        self._last_special = False

    def step(self, token_id: int) -> str:
        """The new text that ``token_id`` completes ("" while a character is still partial)."""
        text = self._stream.step(self._backend, token_id) or ""
        if self._specials is not None:
            special = self._specials.get(token_id)
            if special is not None and self._last_special:
                text = special
            self._last_special = special is not None
        return text
