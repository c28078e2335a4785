"""The floating-point dtypes tapllm computes, captures, sends and stores in, by name.

One table for every place that turns a name into a dtype or back: the engine's ``dtype``
option, ``HiddenStatesSpec.dtype``, the JSON wire format, ``tapllm collect``'s metadata and
its Arrow shards.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Other spellings the engine's ``dtype`` option accepts (not the spec, the wire or a checkpoint's config).
ALIASES: dict[str, str] = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                           "bf16": "bfloat16"}
ARROW_DTYPES = (torch.float32, torch.float16)  # Arrow has no bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the name used in messages, metadata and on the wire."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object, *, aliases: bool = False) -> torch.dtype | None:
    """The dtype a name in :data:`DTYPES` (or, with ``aliases``, in :data:`ALIASES`) stands for; ``None`` if none."""
    if not isinstance(name, str):
        return None
    if aliases:
        name = ALIASES.get(name, name)
    return DTYPES.get(name)


def is_supported(dtype: torch.dtype) -> bool:
    """True for the dtypes of :data:`DTYPES`."""
    return dtype in DTYPES.values()
