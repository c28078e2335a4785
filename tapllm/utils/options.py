"""Building option dataclasses from plain dicts (what JSON bodies and configs give)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def from_mapping(cls: type[T], value: T | Mapping[str, Any], field: str) -> T:
    """``value`` if it already is a ``cls``, else ``cls(**value)``; unknown keys name ``field``."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{field}: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**value)
    raise ValueError(f"{field} must be a {cls.__name__} or a dict, got {type(value).__name__}")
