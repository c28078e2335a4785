"""Values checked where they enter: of the type a field takes, and numbers finite and within the range of
the dtype they will be computed in. Every message names the field, and the limit it broke."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from tapllm.utils.dtypes import dtype_name


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number (Python or NumPy int or float), not a bool."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def is_list_of(value: Any, item: Callable[[Any], bool]) -> bool:
    """A list (tuple, set, array: any iterable but a string or a mapping) whose items all pass ``item``."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        return False
    return all(item(x) for x in value)


def kind(value: Any) -> str:
    """What ``value`` is, for a message: ``int``, ``list holding float``, ``None``."""
    if value is None:
        return "None"
    name = type(value).__name__
    if isinstance(value, list | tuple | set | frozenset):
        inner = sorted({type(x).__name__ for x in value})
        return f"{name} holding {' and '.join(inner)}" if inner else f"empty {name}"
    return name


def real(field: str, value: Any, dtype: torch.dtype = torch.float32) -> float:
    """``value`` as a float; ``ValueError`` naming ``field`` unless it is a number, finite, and within
    ``dtype``'s range (the dtype the engine computes it in)."""
    if not is_real(value):
        raise ValueError(f"{field} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    limit = torch.finfo(dtype).max
    if abs(out) > limit:
        raise ValueError(f"{field} is {out:g}, beyond the range of {dtype_name(dtype)} (at most {limit:.4g} "
                         "in magnitude)")
    return out


def check_values(t: torch.Tensor, field: str, dtype: torch.dtype = torch.float32, *, finite: bool = True) -> None:
    """``ValueError`` naming ``field`` if ``t`` holds NaN or an infinity (unless ``finite`` is false), or a finite
    value beyond ``dtype``'s range (``t`` as given, before a conversion to ``dtype`` makes it an infinity)."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    ok = torch.isfinite(t)
    if not ok.all():
        if finite:
            raise ValueError(f"{field} holds NaN or infinite values")
        t = t[ok]
        if t.numel() == 0:
            return
    limit = torch.finfo(dtype).max
    largest = float(t.abs().max())
    if largest > limit:
        raise ValueError(f"{field} holds {largest:g}, beyond the range of {dtype_name(dtype)} (at most {limit:.4g} "
                         "in magnitude)")


def as_wide_tensor(value: Any) -> torch.Tensor:
    """``value`` as a tensor: a tensor as it is, anything else (lists, arrays) read as float64, so a number
    beyond float32's range is seen as it was given (``torch.as_tensor`` would make it an infinity)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(value, dtype=torch.float64)
