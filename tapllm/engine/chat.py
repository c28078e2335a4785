"""Chat templates: one given by the user (a file or the text), a conversation rendered with the
tokenizer's, and the checks every message passes first. Imports neither torch nor transformers."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tapllm.utils.text import check_unicode


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Render a conversation with the tokenizer's chat template, after checking every message.

    ``continue_final_message`` leaves the last message open (no end-of-turn after it) so the
    model continues it, as vLLM does; it excludes ``add_generation_prompt``.
    ``chat_template_kwargs`` are extra variables for the template (e.g. ``enable_thinking``).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template (give one with chat_template=FILE)")
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        check_message(m, f"messages[{i}]")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt to false to continue the final message")
    extra = _template_kwargs(tokenizer, chat_template_kwargs)
    try:
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # the template itself may raise (jinja's raise_exception, type errors)
        raise ValueError(f"messages: the chat template refused them: {exc}") from None


def _template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` checked: names, and none that would override a rendering option."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(kwargs).__name__}")
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs", "self"}
    reserved |= {"messages"}  # the template's own variable for the conversation
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"chat_template_kwargs: {name!r} is not a valid template variable name")
        if name in reserved:
            raise ValueError(f"chat_template_kwargs.{name} is reserved (an option of the renderer or the "
                             "conversation itself); pass it as a request field where it is one")
    return dict(kwargs)


def load_chat_template(value: str | Path) -> str:
    """A Jinja chat template from a file path, or the template text itself (vLLM's ``--chat-template``).

    ``ValueError`` names ``chat_template`` when the file is missing (for something that does
    not look like a template) or the template does not parse.
    """
    text = str(value)
    path = Path(text)
    try:
        is_file = path.is_file()
    except OSError:  # a template longer than a path may be
        is_file = False
    if is_file:
        text = path.read_text(encoding="utf-8")
    elif "{{" not in text and "{%" not in text:
        raise FileNotFoundError(f"chat_template: no such file: {text}")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        where = f"{path}" if is_file else "the template"
        raise ValueError(f"chat_template: {where} is not a valid Jinja template: line {exc.lineno}: {exc}") from None
    return text


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
