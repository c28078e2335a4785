"""Hidden-state capture: spec (per request) -> plan (per step) -> recorded rows -> result."""

from tapllm.hidden_states.reducers import Reducer, available_reducers, register_reducer
from tapllm.hidden_states.result import HiddenStates
from tapllm.hidden_states.spec import HEAD_POINTS, HIDDEN_POINTS, POINTS, HiddenStatesSpec

__all__ = ["HiddenStatesSpec", "HiddenStates", "Reducer", "register_reducer", "available_reducers", "POINTS", "HIDDEN_POINTS",
           "HEAD_POINTS"]
