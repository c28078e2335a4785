"""Stream tensors out of a folder's safetensors files (sharded or not), or its PyTorch ``.bin`` files.

Older checkpoints (e.g. the intermediate revisions of a training run) ship only
``pytorch_model*.bin``; those are read with ``torch.load(weights_only=True)``, which
unpickles tensors and plain containers only, never arbitrary objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint (safetensors preferred), following a shard index when there is one."""
    if not (folder / "model.safetensors.index.json").is_file() and not any(folder.glob("*.safetensors")):
        bins = _indexed(folder, "pytorch_model.bin.index.json") or sorted(folder.glob("pytorch_model*.bin"))
        if bins:
            return bins
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"corrupt shard index {index}: {exc}") from exc
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint shards listed in {index} are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors (or pytorch_model*.bin) weights in {folder}")
    return files


def _indexed(folder: Path, name: str) -> list[Path]:
    index = folder / name
    if not index.is_file():
        return []
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"corrupt shard index {index}: {exc}") from exc
    return [folder / n for n in names]


def _iter_bin(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # unpickling errors of several kinds
        raise ValueError(f"corrupt checkpoint file {file}: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint file {file} does not hold a state dict")
    yield from state.items()


def iter_weights(folder: Path, group: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint; a corrupt file raises ValueError.

    The file is reopened for each group of tensors: ``safe_open`` maps the whole file, and
    every page read stays in this process's RSS until the mapping is closed, so holding it
    open for the whole load would add the checkpoint's size (e.g. a float32 conversion of a
    bf16 model) to the load-time memory peak. ``group`` tensors are read per mapping (default
    16); a quantized load reads one at a time, so its peak stays near its (smaller) model.
    """
    group = group or _GROUP
    for file in weight_files(folder):
        if file.suffix == ".bin":
            yield from _iter_bin(file)
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
            for start in range(0, len(names), group):
                with safe_open(str(file), framework="pt") as f:
                    batch = [(name, f.get_tensor(name)) for name in names[start : start + group]]
                yield from batch
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"corrupt checkpoint file {file}: {exc}") from exc


_GROUP = 16  # tensors read per mapping of the file
