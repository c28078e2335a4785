"""The class implementing an ``architectures`` entry, imported when its model is built.

The table of supported architectures is plain data in ``tapllm.config`` (reading a config
never imports a model); a family's module is imported only here, when its model is built.
"""

from __future__ import annotations

import importlib

from tapllm.config import ARCHITECTURES


def model_class(architecture: str) -> type:
    """The class implementing ``architecture`` (a ``KeyError`` names the supported ones)."""
    try:
        target = ARCHITECTURES[architecture]
    except KeyError:
        raise KeyError(f"architecture {architecture!r} is not supported; supported: "
                       f"{', '.join(sorted(ARCHITECTURES))}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
