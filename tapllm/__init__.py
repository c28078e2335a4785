"""tapllm: generated text and hidden states from one call, at serving speed."""

from tapllm.hidden_states import HiddenStates, HiddenStatesSpec, register_reducer
from tapllm.llm import LLM
from tapllm.outputs import CompletionOutput, Logprob, RequestOutput
from tapllm.sae import SAE
from tapllm.sampling_params import SamplingParams
from tapllm.steering import Steer
from tapllm.structured.params import StructuredOutputsParams
from tapllm.utils.version import __version__

__all__ = [
    "LLM", "SamplingParams", "HiddenStatesSpec", "HiddenStates", "RequestOutput", "CompletionOutput", "Logprob",
    "register_reducer", "Steer", "StructuredOutputsParams", "SAE",
]
