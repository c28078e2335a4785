"""Structured output: completions constrained to a JSON schema, a regex, a choice or a grammar.

``StructuredOutputsParams`` (what a request asks) -> ``GrammarCompiler.compile`` (a ``Grammar``,
checked once per distinct spec, at admission) -> a ``GrammarMatcher`` per request, built by the
engine core -> ``MaskComputer`` (each step's token masks, computed while the forward pass runs)
-> the sampler masks the rows.
"""

from tapllm.structured.compiler import Grammar, GrammarCompiler, GrammarMatcher
from tapllm.structured.masks import MaskComputer, TokenMask
from tapllm.structured.params import StructuredOutputsParams

__all__ = ["Grammar", "GrammarCompiler", "GrammarMatcher", "MaskComputer", "StructuredOutputsParams", "TokenMask"]
