"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix hashing, LRU eviction."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from tapllm.engine.request import Request


class BlockManager:
    """Hands out KV cache blocks to requests and shares full blocks with equal prefixes.

    A full block is identified by a hash chained over all tokens up to its end and, per
    block, everything else its KV depends on (``Request.block_salt``: a tenant salt, and which
    of its positions which steers touched), so two requests share a block only when its KV
    and everything before it are equal too. Blocks nobody references stay cached in LRU
    order until they are needed.

    Parallel samples of one prompt share its blocks (:meth:`fork`). A shared block is never
    written: a request about to write into one gets a private copy first (copy-on-write), and
    the copies to make are queued in ``pending_copies`` for the runner to perform before the
    step's forward (only a partly filled last prompt block is ever written after a fork).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.hit_tokens = 0  # prompt tokens served from the cache, since start
        self.queried_tokens = 0  # tokens of the requests looked up
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) block copies to make

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (some may still hold reusable cached prefixes)."""
        return len(self.free)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        bs = self.block_size
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else b""
            salt = req.block_salt(i, bs)
            tokens = np.asarray(req.token_ids[i * bs : (i + 1) * bs], dtype=np.int64)
            req.block_hashes.append(hashlib.blake2b(parent + salt + tokens.tobytes(), digest_size=16).digest())
        return req.block_hashes[:num_blocks]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks matching the start of ``req``; the last token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in self._hashes(req, (req.num_tokens - 1) // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.queried_tokens += req.num_tokens
        self.hit_tokens += len(hits) * self.block_size
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens (after taking ``cached`` ones).

        Returns False, changing nothing, when there are not enough free blocks.
        """
        cached = cached or []
        have = len(req.block_table) + len(cached)
        need = self.blocks_needed(req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens)
        reused_free = sum(1 for b in cached if self.ref_counts[b] == 0)
        # The first new token lands in a block already in the table: shared after a fork, it is copied.
        write = req.num_computed_tokens // self.block_size
        cow = not cached and num_new_tokens > 0 and write < len(req.block_table) \
            and self.ref_counts[req.block_table[write]] > 1
        if need - have + cow > len(self.free) - reused_free:
            return False
        if cow:
            src = req.block_table[write]
            dst = self._take_free()
            self.ref_counts[src] -= 1
            req.block_table[write] = dst
            self.pending_copies.append((src, dst))
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1
            req.block_table.append(b)
        for _ in range(need - have):
            req.block_table.append(self._take_free())
        return True

    def _take_free(self) -> int:
        """The least recently used free block, forgotten by the prefix cache, with one reference."""
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
        self.ref_counts[b] = 1
        return b

    def fork(self, parent: Request, child: Request) -> None:
        """Make ``child`` reference every block of ``parent`` (a sample of the same computed prompt)."""
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued copy-on-write copies ``(source, destination)``, now owed by the caller."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, req: Request) -> None:
        """Publish the blocks of ``req`` that are now completely computed."""
        if not self.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens, len(req.token_ids)) // self.block_size  # tokens the host knows
        for i, h in enumerate(self._hashes(req, full)):
            b = req.block_table[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b

    def forget_free_blocks(self) -> list[int]:
        """Forget the prefixes cached in free blocks (their content is about to be dropped); the
        free blocks, in ascending order."""
        for b in self.free:
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
        return sorted(self.free)

    def free_request(self, req: Request) -> None:
        """Drop the request's references. Blocks holding a cached prefix go to the back of the
        LRU list (tail first); blocks holding nothing reusable go to the front, so they are
        handed out again before blocks never used, and the cache's resident memory (its pages
        are committed on first write) stays as small as the work needs."""
        for b in reversed(req.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)
        req.block_table = []
