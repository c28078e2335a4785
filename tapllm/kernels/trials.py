"""What the trials of a kernel build found on this CPU, remembered beside the build.

A build is checked against plain PyTorch before it is used (:func:`tapllm.kernels.fused_kernels`,
:func:`tapllm.kernels.gemv.packed_gemv_ops`). The outcome depends only on the library (its cache
folder already names the source, torch build, compiler and flags), on the CPU and on the
environment variables the kernels read, so it is written once into ``trials-<cpu>.json`` in the
build's folder (by ``python -m tapllm.kernels`` at install, or by the first start) and read by
every later start instead of running the trials again. Only passes are remembered: a failure is
tried again at the next start. ``TAPLLM_KERNEL_TRIALS=always`` runs them at every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

# Environment variables the compiled kernels read at run time (they change what a trial sees).
_KERNEL_ENV = ("TAPLLM_NO_AVX512BF16", "TAPLLM_AMX", "TAPLLM_BF16_DOT")


def cpu_identity() -> str:
    """A short hash of this CPU (model and feature flags), torch's dispatch level and the kernels' environment."""
    parts = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    parts += [f"{name}={os.environ.get(name, '')}" for name in _KERNEL_ENV]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    parts.append(line.strip())
                elif not line.strip() and len(parts) > 2 + len(_KERNEL_ENV):
                    break  # the first processor's block is enough
    except OSError:
        parts.append(platform.processor())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _file(folder: Path) -> Path:
    return folder / f"trials-{cpu_identity()}.json"


def recall(folder: Path | None, name: str) -> Any | None:
    """The remembered pass of trial ``name`` for the build in ``folder`` on this CPU, or None."""
    if folder is None or os.environ.get("TAPLLM_KERNEL_TRIALS") == "always":
        return None
    try:
        return json.loads(_file(folder).read_text()).get(name)
    except (OSError, ValueError):  # none yet, or a torn file: run the trial
        return None


def remember(folder: Path | None, name: str, value: Any) -> None:
    """Record that trial ``name`` passed (``value``: what it found) for the build in ``folder``."""
    if folder is None:
        return
    path = _file(folder)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known[name] = value
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    except OSError:  # a read-only cache: the trials simply run again next time
        tmp.unlink(missing_ok=True)
