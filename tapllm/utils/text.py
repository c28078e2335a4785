"""Checks on text that enters the engine."""

from __future__ import annotations


def check_unicode(text: str, name: str) -> None:
    """``ValueError`` if ``text`` holds a lone surrogate (it cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode: lone surrogate {text[exc.start]!r} at index {exc.start}") \
            from None
