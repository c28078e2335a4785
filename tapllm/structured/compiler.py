"""Constraints compiled to token-level matchers (llguidance), each distinct spec once.

Why llguidance. Measured on the default tokenizer (49,152 tokens), three JSON schemas, one
thread (``benchmarks/structured.py --part libraries``): mask + advance per token llguidance
53 us, outlines-core 17 us, xgrammar 4 us; compile per schema llguidance 1-2 ms, xgrammar
11-18 ms, outlines-core 0.1-0.7 s (it indexes the whole vocabulary per schema). xgrammar is the
fastest per token, but its wheel declares torch and triton as dependencies (hundreds of MB of
GPU tooling a CPU install does not need, and a way for pip to touch the pinned torch); outlines-
core's compile time lands on admission for every new schema. llguidance is a self-contained
wheel with no dependencies, takes JSON schema, regex, Lark and GBNF, and its 53 us a row is
computed in a background thread while the forward pass runs (a decode step of the default
model is tens of ms on CPU), so the cheaper per-token libraries would gain nothing visible.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from tapllm.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and whether it is done."""

    __slots__ = ("matcher", "field_name")

    def __init__(self, matcher: Any, field_name: str) -> None:
        self.matcher = matcher
        self.field_name = field_name

    def accept(self, token: int) -> str | None:
        """Advance by the sampled ``token``; the reason as a message if the grammar refuses it."""
        if self.matcher.consume_token(token):
            return None
        return f"{self.field_name}: the grammar refused token {token}: {self.matcher.get_error()}"

    @property
    def terminated(self) -> bool:
        """True once the output is complete and nothing more can follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher can go no further (it allows no token), or None."""
        return f"{self.field_name}: {self.matcher.get_error()}" if self.matcher.is_error() else None


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary; thread-safe.

    The compiled grammars are cached by the full spec (kind, text, options); the tokenizer is
    fixed per compiler, so the cache is per tokenizer too. A request gets a copy of the
    compiled matcher in its start state, which is cheap. The llguidance tokenizer is built on
    first use (about a second), so instances that never constrain output pay nothing.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for ``params``; ``ValueError`` naming the field if it does not compile."""
        key = params.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is None:
                template = self._compile(params)
                self._cache[key] = template
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return GrammarMatcher(template.deep_copy(), params.field_name)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        where = params.field_name
        grammar = self._grammar_text(params)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{where}: does not compile: {_short(matcher.get_error())}")
        return matcher

    @staticmethod
    def _grammar_text(params: StructuredOutputsParams) -> str:
        """llguidance's grammar definition for ``params`` (nothing checked yet)."""
        import llguidance

        kind, where = params.kind, params.field_name
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else \
                closed_objects(params.json) if params.disable_additional_properties else params.json
            options = {"whitespace_flexible": not params.disable_any_whitespace}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
            except ValueError as exc:
                raise ValueError(f"{where}: not a usable JSON schema: {_short(str(exc))}") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # Lark string literals take JSON's escapes.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        try:  # Lark, or llama.cpp's GBNF converted to Lark
            return llguidance.grammar_from("grammar", params.grammar)
        except ValueError as exc:
            raise ValueError(f"{where}: not a Lark or GBNF grammar: {_short(str(exc))}") from None

    def _tokenizer(self) -> Any:
        if self._lltokenizer is None:
            import llguidance

            try:
                backend = copy.copy(self._hf_tokenizer.backend_tokenizer)  # the Rust tokenizer, as JSON
                backend.no_padding()
                backend.no_truncation()
                self._lltokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                           eos_token=self._eos or None)
            except Exception as exc:  # noqa: BLE001 - reported to the request that needed it
                raise ValueError(f"structured_outputs: this model's tokenizer cannot be used for structured "
                                 f"output: {type(exc).__name__}: {exc}") from None
        return self._lltokenizer


# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
_SCHEMA_KEYS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
                "unevaluatedItems", "propertyNames")
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` (or
    ``unevaluatedProperties``) gets ``additionalProperties: false``: vLLM's default reading."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _LIST_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _MAP_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or \
        (types is None and ("properties" in out or "required" in out))
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _short(message: str, limit: int = 500) -> str:
    return message if len(message) <= limit else message[:limit] + "..."
