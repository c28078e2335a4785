"""A checkpoint's configuration as transformers reads it, without importing transformers at every start.

Importing transformers and building a config with ``AutoConfig`` costs 1-3 s, more than the
rest of a small model's start. Writing a config reader of our own for each family would mean
repeating what each config class derives from ``config.json`` (defaults, ``layer_types``, the
standardized ``rope_parameters``, per-family renames) and keeping it in step with transformers.
Instead transformers reads the checkpoint once; every attribute of the config it built is kept
in tapllm's cache as JSON (:func:`read_hf_config`), keyed by the checkpoint's ``config.json``
and the installed transformers version, and later starts read that. The models read
:class:`HFConfig` attributes exactly as they would read the transformers object;
:meth:`HFConfig.to_transformers` rebuilds that object where a transformers function needs one
(e.g. a scaled rotary embedding's frequencies).
"""

from __future__ import annotations

import json
import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from tapllm.utils.cache import cache_root, files_key
from tapllm.utils.files import atomic_write

logger = logging.getLogger("tapllm")

_FORMAT = "1"  # bump when what a snapshot holds changes


def transformers_version() -> str:
    """The installed transformers version (read from its metadata, without importing it)."""
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "none"


class HFConfig:
    """The attributes of a transformers ``PretrainedConfig``, read back from tapllm's cache.

    ``getattr(config, name, default)`` and ``config.name`` behave as on the transformers object,
    including the config class's aliases (GPT-2's ``hidden_size`` is its ``n_embd``).
    """

    __slots__ = ("_values", "_aliases", "_transformers")

    def __init__(self, values: dict[str, Any], aliases: dict[str, str] | None = None,
                 transformers_config: Any = None) -> None:
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_aliases", aliases or {})
        object.__setattr__(self, "_transformers", transformers_config)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # pickle's and copy's protocol lookups (and no config field starts so)
            raise AttributeError(name)
        try:
            return self._values[self._aliases.get(name, name)]
        except KeyError:
            raise AttributeError(f"{self._values.get('model_type', 'model')} config has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only")

    def __reduce__(self) -> tuple[Any, ...]:
        return HFConfig, (self._values, self._aliases)  # the transformers object is rebuilt where needed

    def __repr__(self) -> str:
        return f"HFConfig({self._values.get('model_type')!r}, {len(self._values)} attributes)"

    def to_dict(self) -> dict[str, Any]:
        """Every attribute, as transformers' ``to_dict`` gave them."""
        return dict(self._values)

    def to_transformers(self) -> Any:
        """The transformers config object with these attributes (imports transformers; built once)."""
        if self._transformers is None:
            from transformers import AutoConfig

            values = dict(self._values)
            config = AutoConfig.for_model(values.pop("model_type"))
            object.__setattr__(self, "_transformers", type(config).from_dict(values))
        return self._transformers


def as_transformers_config(config: Any) -> Any:
    """``config`` itself, or the transformers object an :class:`HFConfig` stands for."""
    return config.to_transformers() if isinstance(config, HFConfig) else config


def read_hf_config(folder: Path) -> HFConfig:
    """The config transformers builds from ``folder/config.json``: from tapllm's cache when it holds
    this file's snapshot for the installed transformers, else from transformers (then cached)."""
    config_file = folder / "config.json"
    key = files_key([config_file], transformers_version(), _FORMAT)
    cached = cache_root() / "configs" / f"{key}.json"
    try:
        snapshot = json.loads(cached.read_text())
        return HFConfig(snapshot["values"], snapshot["aliases"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    snapshot = {"values": json.loads(config.to_json_string(use_diff=False)),
                "aliases": dict(getattr(type(config), "attribute_map", {}))}
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cached, json.dumps(snapshot))
    except OSError as exc:  # a read-only cache: transformers reads the config again next time
        logger.debug("could not cache the config of %s: %s", folder, exc)
    return HFConfig(snapshot["values"], snapshot["aliases"], config)
