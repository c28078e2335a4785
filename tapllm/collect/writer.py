"""The background shard writer and the per-part progress manifest that makes runs resumable.

The engine loop hands over one group of consecutive records at a time (see
``run.plan_groups``); the writer thread makes each group exactly one shard while the engine
computes the next group. After a shard is renamed into place, a line is appended (and
fsynced) to the part's manifest: a shard counts only once it is listed there.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tapllm.collect.shards import SUFFIX, write_error, write_file, write_shard


@dataclass(slots=True)
class ShardEntry:
    """One complete shard as the manifest records it."""

    file: str
    part: int
    seq: int
    rows: int
    requests: list[int]  # [first, end) input indices
    bytes: int
    sha256: str
    cursor: list[int] | None = None  # --dataset: where the input stream stands after this shard


class Manifest:
    """``progress-partNNN.jsonl``: the shards of one part that are complete."""

    def __init__(self, out: Path, part: int) -> None:
        self.out = out
        self.part = part
        self.path = out / f"progress-part{part:03d}.jsonl"

    def load(self) -> list[ShardEntry]:
        """Complete shards; a torn last line (killed mid-append) or a missing shard ends the list."""
        entries: list[ShardEntry] = []
        if not self.path.exists():
            return entries
        for line in self.path.read_text().splitlines():
            try:
                e = ShardEntry(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                break
            f = self.out / e.file
            if not f.exists() or f.stat().st_size != e.bytes:
                break
            entries.append(e)
        return entries

    def reset_to(self, entries: list[ShardEntry]) -> None:
        """Rewrite the manifest with ``entries`` and delete this part's files beyond them."""
        keep = {e.file for e in entries}
        prefix = f"part{self.part:03d}-"
        for f in self.out.iterdir():
            stray_tmp = f.name.startswith((f".{prefix}", f".{self.path.name}.")) and f.name.endswith(".tmp")
            if stray_tmp or (f.name.startswith(prefix) and f.name not in keep):
                f.unlink()
        write_file(self.path, "".join(json.dumps(asdict(e)) + "\n" for e in entries))

    def append(self, entry: ShardEntry) -> None:
        """Record a complete shard durably."""
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(entry)) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise write_error(self.path, exc) from None


def remove_temporaries(out: Path) -> None:
    """Delete the temporaries a killed run left: ours (``.NAME.XXXXXXXX.tmp`` beside each file)
    and safetensors' (it writes through a Rust tempfile, ``.tmp`` + 6 characters).

    Call only while no writer runs in ``out`` (another worker's file would be cut short);
    the folder holds only tapllm's files (see ``run.check_output``).
    """
    for f in out.iterdir():
        library = f.name.startswith(".tmp") and len(f.name) == 10
        ours = f.name.startswith(".") and f.name.endswith(".tmp")
        if (library or ours) and f.is_file():
            f.unlink()


_DONE = object()
Before = Callable[[int, int, list[dict[str, torch.Tensor]]], list[dict[str, torch.Tensor]]]


class ShardWriter:
    """Writes each group of records handed to it as one shard, on a background thread.

    ``put`` waits until the previous group is written, so at most two groups are held: the
    one being written and the one the engine is computing. ``before(first, end, records)``, when
    given, runs on the writer thread ahead of each shard (a recipe writes its own files of the
    group there, so the manifest lists a group only once they are in place) and returns the
    records the shard holds.
    """

    def __init__(self, manifest: Manifest, seq: int, fmt: str, before: Before | None = None) -> None:
        self.manifest = manifest
        self.seq = seq
        self.fmt = fmt
        self.before = before
        self.bytes_written = 0
        self.entries: list[ShardEntry] = []
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tapllm-shard-writer", daemon=True)
        self._thread.start()

    def put(self, first: int, end: int, records: list[dict[str, torch.Tensor]], cursor: list[int] | None = None
            ) -> None:
        """Hand over records [first, end): per record its rows (``token_id``, ``request_index``,
        ``position``, points), in input order; ``cursor`` goes into the manifest entry."""
        self._queue.join()  # the previous shard is on disk (or failed)
        self._raise_if_failed()
        self._queue.put((first, end, records, cursor))

    def close(self) -> list[ShardEntry]:
        """Finish the last shard, stop the thread, re-raise any write error."""
        self._queue.put(_DONE)
        self._thread.join()
        self._raise_if_failed()
        return self.entries

    def abort(self) -> None:
        """Stop after the shard in hand (a whole group: worth keeping for the rerun)."""
        self._queue.put(_DONE)
        self._thread.join(timeout=600)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _DONE:
                    return
                if self._error is None:
                    self._write(*item)
            except BaseException as exc:  # surfaced to the engine loop on its next put / close
                self._error = exc
            finally:
                self._queue.task_done()

    def _write(self, first: int, end: int, records: list[dict[str, torch.Tensor]], cursor: list[int] | None
               ) -> None:
        if self.before is not None:
            records = self.before(first, end, records)
        columns = {k: torch.cat([r[k] for r in records]) for k in records[0]}
        records.clear()  # the concatenated copy is all this shard needs now
        rows = int(columns["position"].shape[0])
        name = f"part{self.manifest.part:03d}-{self.seq:05d}{SUFFIX[self.fmt]}"
        size, digest = write_shard(self.manifest.out / name, columns, self.fmt)
        entry = ShardEntry(name, self.manifest.part, self.seq, rows, [first, end], size, digest, cursor)
        self.manifest.append(entry)
        self.entries.append(entry)
        self.bytes_written += size
        self.seq += 1
