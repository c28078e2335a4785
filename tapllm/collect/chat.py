"""Chat conversations for drafter training data: reading them, and their tokens with a loss mask.

Layouts read (one conversation a record):

- ShareGPT: ``conversations`` (or ``conversation``), a list of ``{"from": "human" | "gpt" |
  "system", "value": ...}``;
- UltraChat 200k / OpenAI: ``messages``, a list of ``{"role": ..., "content": ...}``;
- UltraChat (the original release): ``data``, a list of strings, user and assistant in turn.

Roles are normalised to ``system``, ``user`` and ``assistant`` (``human`` and ``gpt`` too, as
speculators and SpecForge read them); any other role is refused, naming the record.

Tokens and mask: the conversation is rendered with the model's chat template and tokenized
without adding special tokens (the template writes them). The tokens of assistant turn ``j``
are those the full render of turns ``0..j`` adds after the render of turns ``0..j-1`` with the
generation prompt, i.e. the reply and its end-of-turn marker, as speculators' render
boundaries define them; ``loss_mask`` is 1 there and 0 elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Conversation = list[dict[str, str]]
Render = Callable[[Sequence[dict[str, str]], bool], list[int]]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
COLUMNS = ("conversations", "conversation", "messages", "data")


def normalize(record: Any, where: str) -> Conversation:
    """One record (any layout above) as ``[{"role", "content"}, ...]``; ``ValueError`` names ``where``."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a conversation record must be an object, got {type(record).__name__}")
    column = next((c for c in COLUMNS if record.get(c) is not None), None)
    if column is None:
        raise ValueError(f"{where}: needs one of the fields {list(COLUMNS)} (ShareGPT 'conversations', "
                         f"UltraChat 'messages' or 'data'); it has {sorted(record)}")
    turns = record[column]
    if isinstance(turns, str):  # some exports keep the list as a JSON string
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: '{column}' is a string that is not a JSON list") from None
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: '{column}' must be a non-empty list of turns")
    if column == "data":
        if not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'data' must be a list of strings (user and assistant in turn)")
        return [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]
    return [_turn(t, f"{where} {column}[{k}]") for k, t in enumerate(turns)]


def _turn(turn: Any, where: str) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise ValueError(f"{where}: a turn must be an object, got {type(turn).__name__}")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if not isinstance(role, str) or role.lower() not in _ROLES:
        raise ValueError(f"{where}: role {role!r} is not one of {sorted(_ROLES)}")
    if not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string, got {type(content).__name__}")
    return {"role": _ROLES[role.lower()], "content": content}


def read_jsonl(path: Path) -> list[Conversation]:
    """The conversations of a JSONL file; ``ValueError`` names the file and line."""
    if not path.exists():
        raise FileNotFoundError(f"--input: no such file: {path}")
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}:{n}: not a JSON object ({exc})") from None
            out.append(normalize(record, f"{path}:{n}"))
    if not out:
        raise ValueError(f"--input: {path} holds no conversations")
    return out


def read_dataset(ds: Any, name: str, column: str | None) -> list[Conversation]:
    """The conversations of a ``datasets`` dataset (streamed or memory-mapped), in order."""
    columns = ds.column_names
    if column is None and columns is not None:
        column = next((c for c in COLUMNS if c in columns), None)
        if column is None:
            raise ValueError(f"--dataset {name}: no column named one of {list(COLUMNS)} (columns: {columns}); "
                             "name it with --column")
    elif columns is not None and column not in columns:
        raise ValueError(f"--column {column!r} is not a column of --dataset {name} (columns: {columns})")
    out = []
    for n, record in enumerate(ds):
        value = record.get(column) if column is not None else None
        out.append(normalize({column if column in COLUMNS else "messages": value} if column else record,
                             f"--dataset {name} record {n}"))
    if not out:
        raise ValueError(f"--dataset {name} holds no conversations")
    return out


@dataclass(slots=True)
class Tokens:
    """A conversation's token ids and their loss mask (1 on assistant tokens)."""

    ids: list[int]
    mask: list[int]


def render_fn(render_chat: Callable[..., str], tokenizer: Any) -> Render:
    """``render(messages, add_generation_prompt) -> token ids``: the chat template, tokenized
    without added special tokens."""

    def render(messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        text = render_chat(list(messages), add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    return render


def tokens_with_mask(conv: Conversation, render: Render, generation_prompt: bool = False) -> Tokens:
    """The conversation's tokens and loss mask (see the module docstring).

    ``generation_prompt``: end with the generation prompt (masked 0), ready for the model to
    write the next assistant turn.
    """
    ids = render(conv, generation_prompt)
    mask = [0] * len(ids)
    for j, turn in enumerate(conv):
        if turn["role"] != "assistant" or j == 0:
            continue
        before = render(conv[:j], True)
        through = ids if j == len(conv) - 1 and not generation_prompt else render(conv[: j + 1], False)
        start = _common_prefix(before, through)
        end = len(through)
        if ids[:end] != through:
            raise ValueError("the chat template does not render this conversation's turns as prefixes of the whole; "
                             "the assistant tokens cannot be located")
        mask[start:end] = [1] * (end - start)
    return Tokens(ids, mask)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def turns_to_generate(conv: Conversation) -> list[int]:
    """Indices at which a regenerated conversation gets an assistant turn: each assistant turn,
    and after a final user turn."""
    slots = [j for j, t in enumerate(conv) if t["role"] == "assistant"]
    if conv[-1]["role"] == "user":
        slots.append(len(conv))
    return slots


def without_replies(conv: Conversation) -> Iterator[dict[str, str]]:
    """The turns that are kept when the assistant turns are regenerated."""
    return (t for t in conv if t["role"] != "assistant")
