"""The structured-output fields of OpenAI and vLLM request bodies, as ``StructuredOutputsParams``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tapllm.structured.params import StructuredOutputsParams

# vLLM's older extra_body fields and the StructuredOutputsParams field each stands for.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_outputs_from(
    response_format: Mapping[str, Any] | None,
    structured_outputs: Mapping[str, Any] | None,
    guided: Mapping[str, Any],
) -> StructuredOutputsParams | None:
    """The constraint a body asks for, or None; ``ValueError``/``TypeError`` name the field.

    ``response_format`` is OpenAI's (``text``, ``json_object``, ``json_schema``),
    ``structured_outputs`` vLLM's extra_body object, ``guided`` the ``guided_*`` fields given.
    Only one of the three ways may be used in one request.
    """
    asked = [name for name, value in (("response_format", _constraining(response_format)),
                                      ("structured_outputs", structured_outputs)) if value]
    asked += [name for name, value in guided.items() if value is not None]
    if len(asked) > 1:
        raise ValueError(f"{asked[1]}: give only one structured-output field, got {asked}")
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        return _from_response_format(response_format)  # type: ignore[arg-type]
    if name == "structured_outputs":
        values = dict(structured_outputs)  # type: ignore[arg-type]
        return StructuredOutputsParams(**values)
    return StructuredOutputsParams(**{GUIDED_FIELDS[name]: guided[name], "source": name})


def _constraining(response_format: Mapping[str, Any] | None) -> bool:
    return response_format is not None and response_format.get("type") != "text"


def _from_response_format(rf: Mapping[str, Any]) -> StructuredOutputsParams:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format.json_schema is required for type 'json_schema' "
                         "({'name': ..., 'schema': {...}})")
    schema = spec.get("schema")
    if schema is None:  # OpenAI makes it optional: any JSON object then
        return StructuredOutputsParams(json_object=True, source="response_format.json_schema")
    return StructuredOutputsParams(json=schema, source="response_format.json_schema.schema")
