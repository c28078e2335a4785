"""Which engine-core replica a request goes to (``--data-parallel-size N``): prefix affinity, then load.

Each replica has a prefix cache of its own, so a prompt whose first blocks another request
already ran is cheapest on the replica that ran them. The router keeps, per replica, the
chained hashes of the full blocks of the prompts it sent there (as the block manager chains
them: each block's hash covers every token before its end), in a bounded LRU. A request goes
to the replica holding its longest such prefix, unless that replica is much busier than the
least busy one (more than ``slack`` requests in flight beyond it, and more than twice as
many); otherwise to the least busy (fewest in flight, then fewest sent so far).

This is the front end's picture of the replicas' caches: a replica may have evicted a block
the router still remembers (the request then recomputes it there, which is correct, just not
free). Each API server process routes its own requests. With a single replica there is nothing
to choose: no hashes are computed or kept.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def prefix_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained hash of each full block of ``token_ids``."""
    out: list[bytes] = []
    parent = b""
    for end in range(block_size, len(token_ids) + 1, block_size):
        block = ",".join(map(str, token_ids[end - block_size : end])).encode()
        parent = hashlib.blake2b(parent + salt + block, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass(slots=True)
class ReplicaLoad:
    """What the router knows of one replica."""

    in_flight: int = 0
    routed: int = 0
    affinity_routed: int = 0  # requests sent here because it held their prefix
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # block hashes sent here, LRU


class PrefixRouter:
    """Picks a replica for each request (see the module docstring)."""

    def __init__(self, replicas: int, block_size: int, *, max_blocks: int = 1 << 16, slack: int = 4) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = [ReplicaLoad() for _ in range(replicas)]
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.slack = slack

    def choose(self, token_ids: Sequence[int], salt: bytes = b"") -> int:
        """The replica for a prompt; counts it as in flight there until :meth:`done`."""
        if len(self.replicas) == 1:  # nothing to choose: no hashing, and no table growing to its bound
            r = self.replicas[0]
            r.in_flight += 1
            r.routed += 1
            return 0
        hashes = prefix_hashes(token_ids, self.block_size, salt)
        least = min(range(len(self.replicas)), key=lambda i: (self.replicas[i].in_flight, self.replicas[i].routed))
        held = [self._held(r, hashes) for r in self.replicas]
        # the deepest holder; among equally deep ones, the least busy
        pick = max(range(len(self.replicas)), key=lambda i: (held[i], -self.replicas[i].in_flight,
                                                             -self.replicas[i].routed))
        depth = held[pick]
        if depth and self._much_busier(self.replicas[pick], self.replicas[least]):
            pick, depth = least, 0
        r = self.replicas[pick]
        r.in_flight += 1
        r.routed += 1
        r.affinity_routed += depth > 0
        for h in hashes:
            r.blocks[h] = None
            r.blocks.move_to_end(h)
        while len(r.blocks) > self.max_blocks:
            r.blocks.popitem(last=False)
        return pick

    def done(self, replica: int) -> None:
        """A request sent to ``replica`` has finished (or failed, or was aborted)."""
        self.replicas[replica].in_flight -= 1

    @staticmethod
    def _held(r: ReplicaLoad, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt ``r`` holds."""
        n = 0
        for h in hashes:
            if h not in r.blocks:
                break
            n += 1
        return n

    def _much_busier(self, a: ReplicaLoad, b: ReplicaLoad) -> bool:
        return a.in_flight > b.in_flight + self.slack and a.in_flight > 2 * b.in_flight
