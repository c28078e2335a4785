"""Model ids on the Hugging Face Hub (``"EleutherAI/pythia-70m"``), resolved through ``huggingface_hub``.

The local Hugging Face cache is tried first (``HF_HOME`` / ``HF_HUB_CACHE`` or ``download_dir``,
at ``revision``); only when the files are not there, and the network is allowed
(``HF_HUB_OFFLINE`` unset), are they downloaded. A miss gives an error naming the id, the
revision, the cache folder searched and ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger("tapllm")

# What a checkpoint needs; a repository's other files (PyTorch .bin duplicates, ONNX, ...) are not fetched.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.tiktoken", "merges.txt",
               "vocab.txt"]
TOKENIZER_FILES = ["*.json", "tokenizer*", "*.model", "*.jinja", "*.tiktoken", "merges.txt", "vocab.txt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` or ``name``: what the Hub accepts as a model id (a local path is checked first)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".gguf", ".safetensors"))


def snapshot(repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None,
             patterns: list[str] | None = None, what: str = "model") -> Path:
    """The local folder of ``repo_id`` at ``revision`` from the Hub cache, downloading it if allowed."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = patterns if patterns is not None else MODEL_FILES
    cache = str(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns,
                                        local_files_only=True))
        logger.info("%s %s (%s) found in the Hugging Face cache %s", what, repo_id, revision or "main", cache)
        return folder
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # a malformed id or revision, a broken cache entry
        raise ValueError(f"{what} {repo_id!r}: {exc}") from None
    where = f"{what} {repo_id!r} (revision {revision or 'main'}) is not in the Hugging Face cache {cache}"
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{where}, and HF_HUB_OFFLINE is set so it cannot be downloaded; download it "
                                "where the Hub is reachable, or give a local folder or .gguf file")
    logger.info("downloading %s %s (%s) into %s", what, repo_id, revision or "main", cache)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns))
        if patterns is MODEL_FILES and not any(folder.glob("*.safetensors")):
            # An older checkpoint (e.g. a training run's intermediate revision): PyTorch weights only.
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                            allow_patterns=[*patterns, "pytorch_model*.bin*"]))
        return folder
    except Exception as exc:  # network errors, unknown repositories, gated models
        raise FileNotFoundError(f"{where}, and downloading it failed ({type(exc).__name__}: {exc}); set "
                                "HF_HUB_OFFLINE=1 to stop trying, or give a local folder or .gguf file") from None
