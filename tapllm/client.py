"""Client helpers for tapllm's HTTP API (usable with the official ``openai`` client)."""

from __future__ import annotations

from typing import Any

from tapllm.hidden_states.json_codec import hidden_states_from_wire
from tapllm.hidden_states.result import HiddenStates


def decode_hidden_states(choice: Any) -> HiddenStates | None:
    """The ``HiddenStates`` of one response choice (or a ``/v1/hidden_states`` data item).

    Accepts the ``openai`` client's choice objects (the extension arrives as an extra field)
    and plain dicts from the JSON. Returns None when the choice carries no states.
    """
    if isinstance(choice, dict):
        wire = choice.get("hidden_states")
    else:
        wire = getattr(choice, "hidden_states", None)
        if wire is None and getattr(choice, "model_extra", None):
            wire = choice.model_extra.get("hidden_states")
    if wire is None:
        return None
    if not isinstance(wire, dict):  # some clients wrap extras in their own objects
        wire = wire.model_dump() if hasattr(wire, "model_dump") else dict(wire)
    return hidden_states_from_wire(wire)
