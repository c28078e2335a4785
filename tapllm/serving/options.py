"""The settings of a Ray Serve deployment of tapllm, from Python or from ``serve run`` arguments.

``serve run tapllm.serving.ray:build_app model=PATH num_replicas=2 enable_hidden_states=true``
hands the builder every ``key=value`` as text; :meth:`RayServeOptions.from_strings` converts
each by the type of its field (deployment settings here, engine settings from ``EngineConfig``)
and refuses unknown keys and unreadable values by name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tapllm.config import EngineConfig

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# The engine settings ``tapllm serve`` starts with where they differ from ``EngineConfig``'s (a shared service).
SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"enable_hidden_states": False, "enable_steering": False,
                                         "hidden_states_max_bytes_per_request": 64 << 20}


@dataclass(slots=True)
class RayServeOptions:
    """One tapllm engine per Ray Serve replica, and a front deployment routing by prompt prefix.

    Args:
        model: the model folder or ``.gguf`` file; it must be at this path on every node.
        num_replicas: engine replicas (one per node: give each a node's CPUs).
        cpus_per_replica: CPUs Ray reserves for each replica (its torch threads too); set it to
            a node's CPU count so that Ray places one replica per node.
        served_model_name: the model id clients use (default: the folder name or GGUF stem).
        api_key: require ``Authorization: Bearer KEY`` (checked by each replica's app, as
            ``tapllm serve`` does; the front skips tokenizing bodies without it).
        max_request_bytes: largest request body (413 beyond), at the front and in each replica.
        max_prompts_per_request: most prompts in one completions or hidden_states request.
        max_ongoing_requests: requests Ray Serve lets into one replica (and the front) at once;
            the engine schedules them itself, so this is high.
        engine: further ``EngineConfig`` settings (``dtype``, ``max_num_seqs``, ``block_size``,
            ``enable_hidden_states``...); unset ones take ``tapllm serve``'s defaults.
    """

    model: str
    num_replicas: int = 1
    cpus_per_replica: float = 1.0
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = 8 << 20
    max_prompts_per_request: int = 256
    max_ongoing_requests: int = 1000
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str | Path) or not str(self.model):
            raise ValueError(f"model must be a path, got {self.model!r}")
        self.model = str(self.model)
        for name in ("num_replicas", "max_request_bytes", "max_prompts_per_request", "max_ongoing_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.cpus_per_replica, bool) or not isinstance(self.cpus_per_replica, int | float) \
                or not self.cpus_per_replica > 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty")
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(self.engine) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; EngineConfig has {sorted(known)}")
        self.engine_config().validate()

    @property
    def model_name(self) -> str:
        """The id clients use."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name

    @property
    def block_size(self) -> int:
        """Tokens per KV block: the router hashes prompts in blocks of this size, as the engines cache them."""
        return int(self.engine_config().block_size)

    @property
    def torch_threads(self) -> int:
        """Intra-op threads of each replica's engine: its CPUs (at least one)."""
        return max(1, int(self.cpus_per_replica))

    def engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` of every replica."""
        return EngineConfig(model=self.model, **{**SERVE_ENGINE_DEFAULTS, **self.engine})

    @classmethod
    def from_strings(cls, args: Mapping[str, str]) -> RayServeOptions:
        """Options from ``serve run``'s ``key=value`` texts (``none`` for an optional setting left unset)."""
        mine = {f.name: f for f in dataclasses.fields(cls) if f.name != "engine"}
        hints = typing.get_type_hints(cls)
        engine_hints = typing.get_type_hints(EngineConfig)
        values: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for key, text in args.items():
            if key in mine:
                values[key] = _convert(key, text, hints[key])
            elif key in engine_hints and key != "model":
                engine[key] = _convert(key, text, engine_hints[key])
            else:
                raise ValueError(f"unknown setting {key!r}: expected one of {sorted(mine)} or an EngineConfig "
                                 f"setting ({sorted(set(engine_hints) - {'model'})})")
        if "model" not in values:
            raise ValueError("model is required (model=PATH: a folder or .gguf file on every node)")
        return cls(**values, engine=engine)


def _convert(key: str, text: Any, hint: Any) -> Any:
    """``text`` as a value of type ``hint`` (``int``, ``float``, ``bool``, ``str``, paths, dtypes, ``X | None``)."""
    if not isinstance(text, str):
        return text  # already typed (a YAML config's ``args`` may be)
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if type(None) in options and text.strip().lower() in ("none", "null", ""):
        return None
    for kind in (bool, int, float):
        if kind in options:
            return _as(key, text, kind)
    if str in options or Path in options:
        return text
    raise ValueError(f"{key}: cannot read {text!r} as {hint}")


def _as(key: str, text: str, kind: type) -> Any:
    value = text.strip().lower()
    if kind is bool:
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{key} must be true or false, got {text!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
