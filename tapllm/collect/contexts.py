"""Fixed-size model contexts from a stream of tokenized documents, with SAELens' conventions.

With ``prepend_bos`` every document is read as ``[BOS] + its tokens`` (so in a packed stream
documents are separated by BOS), and every context starts with BOS: when the context's first
token is not already BOS, one is put in front, and the context takes ``size - 1`` tokens of
the stream. Documents are tokenized without special tokens; BOS is added only here.

- ``packing``: the documents are concatenated and cut into contexts of ``size`` tokens
  (SAELens' concatenate-and-chunk); a document runs on into the next context.
- otherwise each document is cut by itself into contexts of at most ``size`` tokens (a long
  document gives several, the last one shorter), or with ``truncate`` only its first context
  is kept.

The last context of a packed stream (or of a ``--max-tokens-total`` budget) may be shorter
than ``size``: rows are tokens, so nothing read is dropped.

After each context the builder reports a :class:`Cursor`, three integers from which the
stream continues exactly (the tokens still pending are always a suffix of the last document
read), so a resumed collection rebuilds the same contexts without re-reading what it did.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ContextSettings:
    """How documents become contexts (see the module docstring)."""

    size: int
    packing: bool = False
    truncate: bool = False
    bos_token_id: int | None = None  # prepend BOS when set
    max_records: int | None = None  # read at most this many documents
    max_tokens: int | None = None  # emit at most this many tokens in all

    def validate(self) -> None:
        """``ValueError`` naming the bad setting."""
        if self.size < 2:
            raise ValueError(f"--context-size must be >= 2, got {self.size}")
        if self.packing and self.truncate:
            raise ValueError("--packing and --truncate exclude each other (packing never truncates)")
        if self.max_records is not None and self.max_records < 1:
            raise ValueError(f"--max-rows must be >= 1, got {self.max_records}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens-total must be >= 1, got {self.max_tokens}")


@dataclass(slots=True, frozen=True)
class Cursor:
    """Where the stream stands after a context: ``records`` documents read, the last
    ``carry`` tokens of the last one (BOS included) still pending, ``tokens`` emitted."""

    records: int = 0
    carry: int = 0
    tokens: int = 0

    def to_list(self) -> list[int]:
        """The JSON form kept in a shard's manifest entry."""
        return [self.records, self.carry, self.tokens]

    @classmethod
    def from_list(cls, value: list[int] | None) -> Cursor:
        """The inverse of :meth:`to_list` (``None``: the start)."""
        return cls() if value is None else cls(*value)


def build_contexts(docs: Iterator[list[int]], s: ContextSettings, start: Cursor = Cursor()
                   ) -> Iterator[tuple[list[int], Cursor]]:
    """Contexts (lists of token ids) and the cursor after each.

    ``docs`` yields the token lists of the documents after ``start.records - 1`` when
    ``start.carry`` is set (the document whose tail is pending comes again first), else after
    ``start.records``.
    """
    records, tokens = start.records, start.tokens
    bos = s.bos_token_id
    buf: list[int] = []
    pos = 0
    if start.carry:
        doc = next(docs, None)
        if doc is None:
            raise ValueError(f"the input ended before record {records - 1}, where the previous run stopped: "
                             "it changed since")
        buf = _document(doc, s)[-start.carry:]
    while s.max_tokens is None or tokens < s.max_tokens:
        # top up: packing keeps a full context ready; otherwise one document at a time
        while len(buf) - pos < (s.size if s.packing else 1):
            if s.max_records is not None and records >= s.max_records:
                break
            doc = next(docs, None)
            if doc is None:
                break
            records += 1
            buf, pos = buf[pos:] + _document(doc, s), 0
        if pos == len(buf):
            return
        lead = [bos] if bos is not None and buf[pos] != bos else []
        room = s.size if s.max_tokens is None else min(s.size, s.max_tokens - tokens)
        take = min(max(room - len(lead), 0), len(buf) - pos)
        ctx = (lead + buf[pos : pos + take])[:room]
        pos += take
        tokens += len(ctx)
        if pos > 4 * s.size:  # keep slicing a long document cheap
            buf, pos = buf[pos:], 0
        yield ctx, Cursor(records, len(buf) - pos, tokens)


def _document(doc: list[int], s: ContextSettings) -> list[int]:
    full = [s.bos_token_id, *doc] if s.bos_token_id is not None else list(doc)
    return full[: s.size] if s.truncate else full
