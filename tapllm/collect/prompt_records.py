"""Prompt records from files: the one JSONL reader of ``tapllm generate/encode --input`` and
``tapllm collect --input``.

A record is an object with one of ``messages`` (a chat, rendered with the model's chat
template), ``prompt_token_ids``, ``text`` or ``prompt``. When a record holds several, the
first in that order wins (a field set to ``null`` counts as absent), so ``text`` wins over
``prompt``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = ("text", "prompt", "messages", "prompt_token_ids")


@dataclass(slots=True)
class Item:
    """One input record: ``kind`` is ``"text"``, ``"messages"`` or ``"ids"``."""

    kind: str
    value: Any


def record_item(rec: Any, where: str) -> Item:
    """The prompt a record holds; ``ValueError`` starts with ``where`` (``file:line``, ``file row N``)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: each record must be an object with one of {list(FIELDS)}")
    if rec.get("messages") is not None:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        return Item("messages", msgs)
    if rec.get("prompt_token_ids") is not None:
        ids = rec["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a list of integers")
        return Item("ids", ids)
    text = rec.get("text", rec.get("prompt"))
    if text is None:
        raise ValueError(f"{where}: needs a 'text', 'prompt', 'messages' or 'prompt_token_ids' field "
                         f"(found {sorted(rec)})")
    if not isinstance(text, str):
        raise ValueError(f"{where}: 'text' must be a string")
    return Item("text", text)


def read_jsonl(path: Path) -> list[Item]:
    """The records of a JSONL file, one object per line (blank lines skipped, a leading
    byte-order mark allowed). ``ValueError`` names ``file:line`` for invalid UTF-8, invalid
    JSON or a record without a usable field."""
    if not path.is_file():
        raise FileNotFoundError(f"--input: no such file: {path}")
    items = []
    with path.open("rb") as f:  # decoded line by line, so an error names its line
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte "
                                 f"{exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            items.append(record_item(rec, f"{path}:{n}"))
    if not items:
        raise ValueError(f"--input: {path} holds no records")
    return items


def to_prompt(item: Item, render_chat: Callable[[Sequence[dict[str, Any]]], str], chat: bool = False
              ) -> str | list[int]:
    """The engine prompt for ``item``: a chat rendered with ``render_chat``; with ``chat``, a
    text record too, as one user message."""
    if item.kind == "messages":
        return render_chat(item.value)
    if chat and item.kind == "text":
        return render_chat([{"role": "user", "content": item.value}])
    return item.value
