"""Constraints compiled to token-level matchers (llguidance), each distinct spec once.

Why llguidance (``benchmarks/structured.py --part libraries`` compares the three): xgrammar is
the fastest per token, but its wheel declares torch and triton as dependencies (GPU tooling a
CPU install does not need, and a way for pip to touch the pinned torch); outlines-core indexes
the whole vocabulary per schema, so its compile time lands on admission for every new schema.
llguidance is a self-contained wheel with no dependencies, takes JSON schema, regex, Lark and
GBNF, compiles a schema quickly, and its per-token cost is paid in a background thread while
the forward pass runs (a decode step takes far longer), so the cheaper per-token libraries
would gain nothing visible.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tapllm.structured.params import StructuredOutputsParams
from tapllm.utils.platform import release_free_memory

CACHE_SIZE = 256  # compiled grammars (and specs) kept, least recently used dropped first


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


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint as llguidance's grammar text, checked to compile, and the request field it came from.

    Plain data: what the input processor hands the engine core, which builds matchers from it.
    """

    text: str
    field_name: str


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary; thread-safe.

    :meth:`compile` turns a spec into a :class:`Grammar` (its text, checked by compiling it);
    :meth:`matcher` gives a request a copy of the compiled matcher in its start state, which is
    cheap. Compiled grammars are cached by their text, specs by their full key (kind, text,
    options); the tokenizer is fixed per compiler, so the cache is per tokenizer too. The
    llguidance tokenizer is built on first use (about a second), so instances that never
    constrain output pay nothing.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer: Any = None
        self._grammars: OrderedDict[tuple, Grammar] = OrderedDict()  # spec key -> its grammar
        self._cache: OrderedDict[str, Any] = OrderedDict()  # grammar text -> compiled matcher (start state)
        self._lock = threading.Lock()

    def warm_in_background(self) -> threading.Thread:
        """Build the llguidance tokenizer now, on a daemon thread (a server calls this at start, as
        SGLang builds its grammar backend at start): the first constrained request does not pay
        its second, and the memory it holds counts in the server's baseline instead of looking like
        a leak after the first burst. A tokenizer llguidance cannot take is reported, as ever, to
        the request that needs it."""

        def build() -> None:
            with self._lock:
                try:
                    self._tokenizer()
                except ValueError:
                    pass
            release_free_memory()  # the build's temporaries

        thread = threading.Thread(target=build, name="tapllm-grammar-tokenizer", daemon=True)
        thread.start()
        return thread

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """``params`` as a checked :class:`Grammar`; ``ValueError`` naming the field if it does not compile."""
        key = params.cache_key()
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is None:
                grammar = Grammar(self._grammar_text(params), params.field_name)
                self._template(grammar)
                _remember(self._grammars, key, grammar)
            else:
                self._grammars.move_to_end(key)
            return grammar

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for ``grammar`` (compiled once per text)."""
        with self._lock:
            return GrammarMatcher(self._template(grammar).deep_copy(), grammar.field_name)

    def _template(self, grammar: Grammar) -> Any:
        """The compiled matcher of ``grammar`` in its start state (caller holds the lock)."""
        template = self._cache.get(grammar.text)
        if template is None:
            template = self._compile(grammar)
            _remember(self._cache, grammar.text, template)
        else:
            self._cache.move_to_end(grammar.text)
        return template

    def _compile(self, grammar: Grammar) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar.text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{grammar.field_name}: does not compile: {_short(matcher.get_error())}")
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


def _remember(cache: OrderedDict, key: Any, value: Any) -> None:
    """Put ``value`` in an LRU ``cache`` of :data:`CACHE_SIZE` entries (the least recently used dropped)."""
    cache[key] = value
    if len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


def _short(message: str, limit: int = 500) -> str:
    return message if len(message) <= limit else message[:limit] + "..."
