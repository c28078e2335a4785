"""What a request's output must match: vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tapllm.utils.options import from_mapping
from tapllm.utils.text import check_unicode

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a completion to a JSON schema, a regular expression, a choice of strings, a grammar,
    or any JSON object; exactly one of them, as in vLLM.

    ``json``: a JSON schema (a dict, or its JSON text). ``regex``: a regular expression the whole
    output matches (Rust ``regex`` syntax). ``choice``: the output is exactly one of these strings.
    ``grammar``: a context-free grammar in Lark syntax or llama.cpp's GBNF (EBNF). ``json_object``:
    ``True`` for any JSON object. ``disable_any_whitespace`` (as in vLLM) makes JSON compact: no
    whitespace between tokens besides what the separators hold.

    ``disable_additional_properties`` (vLLM's field; ``True`` here by default) reads a JSON schema
    as vLLM's default backend does: an object schema without ``additionalProperties`` is closed, so
    only the keys it lists may appear. ``False`` gives JSON Schema's own reading, where such an
    object takes any extra key. An explicit ``additionalProperties`` is always honoured.

    When the output is complete the grammar allows only EOS, which is sampled (it is the last of
    ``token_ids``, ``stop_reason`` is ``None``), as in vLLM; ``max_tokens`` can still cut the output
    short (``finish_reason == "length"``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True
    # The field a user wrote, for error messages (e.g. "response_format.json_schema.schema").
    source: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_any(cls, value: StructuredOutputsParams | Mapping[str, Any]) -> StructuredOutputsParams:
        """``value`` itself, or the params built from a dict of their fields."""
        return from_mapping(cls, value, "structured_outputs")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """The request field that holds the constraint, as the user wrote it."""
        return self.source or f"structured_outputs.{self.kind}"

    def validate(self) -> None:
        """``ValueError``/``TypeError`` naming the field unless exactly one well-typed constraint is set."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {list(KINDS)}, got "
                             f"{given or 'none'}")
        where = self.field_name
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: the schema is not valid JSON: {exc}") from None
            if not isinstance(self.json, Mapping):
                raise TypeError(f"{where} must be a JSON schema (an object), got {type(self.json).__name__}")
            try:
                json.dumps(self.json, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}: the schema is not JSON: {exc}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise TypeError(f"{self.source or 'structured_outputs.' + name} must be a non-empty string")
                check_unicode(value, self.source or f"structured_outputs.{name}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple) or not self.choice:
                raise TypeError(f"{where} must be a non-empty list of strings")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str) or not c:
                    raise TypeError(f"{where}[{i}] must be a non-empty string, got {c!r}")
                check_unicode(c, f"{where}[{i}]")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"{where} must be true or false, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be true or false")

    def cache_key(self) -> tuple[str, str, bool, bool]:
        """The full spec as text: equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        # Not sorted: property order is the order the output writes them in.
        text = json.dumps(value, ensure_ascii=False) if kind in ("json", "choice") else str(value)
        return kind, text, self.disable_any_whitespace, self.disable_additional_properties
