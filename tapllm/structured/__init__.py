"""Structured output: completions constrained to a JSON schema, a regex, a choice or a grammar.

``StructuredOutputsParams`` (what a request asks) -> ``GrammarCompiler`` (compiled once per
distinct spec, at admission) -> a ``GrammarMatcher`` per request -> ``MaskComputer`` (each
step's token masks, computed while the forward pass runs) -> the sampler masks the rows.
"""

from tapllm.structured.compiler import GrammarCompiler, GrammarMatcher
from tapllm.structured.masks import MaskComputer, TokenMask
from tapllm.structured.params import StructuredOutputsParams

__all__ = ["GrammarCompiler", "GrammarMatcher", "MaskComputer", "StructuredOutputsParams", "TokenMask"]
