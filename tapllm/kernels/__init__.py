"""tapllm's fused CPU kernels (C++, built once with the machine's compiler), behind a probe.

:func:`fused_kernels` returns the op namespace of the variant that fits this CPU (AVX512,
AVX2 or generic, following the instruction set torch's own kernels dispatch to), after a
trial run of every op against plain PyTorch (once per build and CPU: a pass is remembered beside
the build, see :mod:`tapllm.kernels.trials`); ``None`` (and a logged reason) when there is no
compiler, the build or the trial fails, the device is not a CPU, or ``TAPLLM_KERNELS=0``.
Callers then keep the eager PyTorch code, which stays the reference.

``python -m tapllm.kernels`` builds and tries them ahead of time (``scripts/install.sh`` does).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from tapllm.kernels.trials import recall, remember

logger = logging.getLogger("tapllm")

_state: dict[str, Any] = {}


def variant() -> str:
    """The instruction-set variant for this process (torch's own dispatch decides, incl. ATEN_CPU_CAPABILITY)."""
    isa = torch.backends.cpu.get_cpu_capability().upper()
    if isa.startswith(("AVX512", "AMX")):
        return "avx512"
    if isa.startswith("AVX2"):
        return "avx2"
    return "default"


def fused_kernels() -> Any | None:
    """The loaded ops (``torch.ops.tapllm_<variant>``), or None when they cannot be used here."""
    if "ops" not in _state:
        _state["ops"], _state["reason"] = _load()
        if _state["ops"] is None:
            logger.warning("fused CPU kernels off (%s): the eager PyTorch step runs", _state["reason"])
        else:
            logger.info("fused CPU kernels: %s", _state["reason"])
    return _state["ops"]


def build_folder(ops: Any) -> Path | None:
    """The cache folder of the build ``ops`` came from: None unless ``ops`` are this process's loaded kernels."""
    return _state.get("folder") if ops is not None and ops is _state.get("ops") else None


def kernels_status() -> str:
    """One line: which kernels run, or why none do (after :func:`fused_kernels` was called)."""
    fused_kernels()
    return _state["reason"]


def _load() -> tuple[Any | None, str]:
    if os.environ.get("TAPLLM_KERNELS", "1") == "0":
        return None, "TAPLLM_KERNELS=0"
    from tapllm.kernels.build import build

    name = variant()
    try:
        path = build(name)
        ns = f"tapllm_{name}"
        if not hasattr(torch.ops, ns) or not hasattr(getattr(torch.ops, ns), "decode_attention"):
            torch.ops.load_library(str(path))
        ops = getattr(torch.ops, ns)
        tried = not recall(path.parent, "kernels")
        problem = _trial(ops) if tried else None
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the eager path
        return None, f"{name} build/load failed: {str(exc).strip().splitlines()[-1][:300]}"
    if problem:
        return None, f"{name} kernels disagree with PyTorch: {problem}"
    if tried:
        remember(path.parent, "kernels", True)
    _state["folder"] = path.parent
    return ops, f"{name} ({path.parent.name})"


def _trial(ops: Any) -> str | None:
    """Run every op on small inputs against plain PyTorch; a description of the first mismatch."""
    from tapllm.kernels.reference import check_all

    return check_all(ops)
