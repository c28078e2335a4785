"""Whether a Triton launch must emulate bfloat16 rounding, decided on the host without importing triton
(the Triton functions that round are in ``triton_rounding.py``, imported only where a kernel runs)."""

from __future__ import annotations

import torch


def emulate_rne(interpreted: bool, dtype: torch.dtype) -> bool:
    """Whether a launch must emulate bfloat16 rounding: in Triton's interpreter, which casts float32 to
    bfloat16 by truncation (see ``triton_rounding.py``)."""
    return interpreted and dtype == torch.bfloat16
