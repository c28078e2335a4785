"""Which loop runs a part of a collection: ``tapllm collect``'s own, or a recipe's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tapllm.collect.eagle3 import FOLDERS
from tapllm.collect.part import CollectConfig

RECIPE_FOLDERS = FOLDERS  # folders of --out that a recipe writes


def part_runner(cfg: CollectConfig) -> Callable[..., Any]:
    """``run_part(engine, cfg, source, part, show_progress)`` for this run."""
    if cfg.recipe is not None:
        from tapllm.collect.eagle3_part import run_part as recipe_part

        return recipe_part
    from tapllm.collect.part import run_part

    return run_part
