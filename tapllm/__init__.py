"""tapllm: generated text and hidden states from one call, at serving speed.

The public names are imported on first use (PEP 562): ``import tapllm`` alone imports neither
torch nor any engine code, so the command line can check its arguments (and a busy port) before
paying for them, and ``from tapllm import LLM`` imports what ``LLM`` needs and nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tapllm.utils.version import __version__

if TYPE_CHECKING:
    from tapllm.hidden_states import HiddenStates, HiddenStatesSpec, register_reducer
    from tapllm.llm import LLM
    from tapllm.outputs import CompletionOutput, Logprob, RequestOutput
    from tapllm.sae import SAE
    from tapllm.sampling_params import SamplingParams
    from tapllm.steering import Steer
    from tapllm.structured.params import StructuredOutputsParams

# name -> the module that defines it
_EXPORTS = {
    "LLM": "tapllm.llm", "SamplingParams": "tapllm.sampling_params", "HiddenStatesSpec": "tapllm.hidden_states",
    "HiddenStates": "tapllm.hidden_states", "register_reducer": "tapllm.hidden_states",
    "RequestOutput": "tapllm.outputs", "CompletionOutput": "tapllm.outputs", "Logprob": "tapllm.outputs",
    "Steer": "tapllm.steering", "StructuredOutputsParams": "tapllm.structured.params", "SAE": "tapllm.sae",
}
__all__ = [
    "LLM", "SamplingParams", "HiddenStatesSpec", "HiddenStates", "RequestOutput", "CompletionOutput", "Logprob",
    "register_reducer", "Steer", "StructuredOutputsParams", "SAE",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if name.startswith("__"):
        raise AttributeError(f"module 'tapllm' has no attribute {name!r}")
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    else:
        try:  # a subpackage (``tapllm.engine``) reached as an attribute, as after an eager import
            value = importlib.import_module(f"tapllm.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tapllm.{name}":
                raise
            raise AttributeError(f"module 'tapllm' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
