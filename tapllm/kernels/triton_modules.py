"""A Triton kernels module, imported on first use, and where its kernels can run.

Every ``triton_*.py`` wrapper imports its ``triton_*_kernels.py`` through :func:`kernels_module`
(importing triton is slow and may fail: a missing or broken install leaves the eager paths) and
answers ``available`` through :func:`runs_on`.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch


@functools.cache
def kernels_module(name: str) -> Any | None:
    """``tapllm.kernels.<name>`` (importing triton), or None when triton cannot be imported."""
    try:
        return importlib.import_module(f"tapllm.kernels.{name}")
    except Exception:  # noqa: BLE001 - a missing or broken triton install: the kernels cannot run
        return None


def runs_on(kernels: Any | None, device: torch.device | str | torch.Tensor) -> bool:
    """Whether ``kernels`` (a module from :func:`kernels_module`) run on ``device`` (or a tensor's): CUDA, or
    the CPU with Triton's interpreter on (``TRITON_INTERPRET=1``, set before triton is first imported)."""
    if kernels is None:
        return False
    dev = device.device if isinstance(device, torch.Tensor) else torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return dev.type == "cpu" and kernels.INTERPRETED
