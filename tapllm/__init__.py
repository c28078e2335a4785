"""tapllm: generated text and hidden states from one call, at serving speed."""

from tapllm.llm import LLM
from tapllm.outputs import CompletionOutput, Logprob, RequestOutput
from tapllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
