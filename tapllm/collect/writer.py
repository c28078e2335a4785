"""The background shard writer and the per-part progress manifest that makes runs resumable.

Finished requests arrive in any order; the writer thread puts them back in input order and
cuts shards at request boundaries once a shard holds ``shard_tokens`` rows (so a shard
exceeds that by less than one request). After each shard is renamed into place, a line is
appended (and fsynced) to the part's manifest: a shard counts only once it is listed there.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tapllm.collect.shards import SUFFIX, write_shard


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
            stray_tmp = f.name.startswith(f".{prefix}") and f.name.endswith(".tmp")
            if stray_tmp or (f.name.startswith(prefix) and f.name not in keep):
                f.unlink()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(asdict(e)) + "\n" for e in entries))
        os.replace(tmp, self.path)

    def append(self, entry: ShardEntry) -> None:
        """Record a complete shard durably."""
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(entry)) + "\n")
            f.flush()
            os.fsync(f.fileno())


def remove_library_temporaries(out: Path) -> None:
    """Delete temporaries a killed run left: safetensors writes through a Rust tempfile
    (``.tmp`` + 6 characters) beside its target.

    Call only while no writer runs in ``out`` (another worker's file would be cut short);
    the folder holds only tapllm's files (see ``run.prepare_output``).
    """
    for f in out.iterdir():
        if f.name.startswith(".tmp") and len(f.name) == 10 and f.is_file():
            f.unlink()


_DONE = object()


class OrderedShardWriter:
    """Writes shards of whole requests, in input order, on a background thread."""

    def __init__(self, manifest: Manifest, next_index: int, seq: int, shard_tokens: int, fmt: str) -> None:
        self.manifest = manifest
        self.next_index = next_index
        self.seq = seq
        self.shard_tokens = shard_tokens
        self.fmt = fmt
        self.bytes_written = 0
        self.rows_written = 0
        self.entries: list[ShardEntry] = []
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._buffer: list[dict[str, torch.Tensor]] = []
        self._buffer_first = next_index
        self._buffer_rows = 0
        self._queue: queue.Queue = queue.Queue(maxsize=256)  # backpressure on the engine loop
        self._error: BaseException | None = None
        self._aborted = False
        self._thread = threading.Thread(target=self._run, name="tapllm-shard-writer", daemon=True)
        self._thread.start()

    def put(self, index: int, columns: dict[str, torch.Tensor]) -> None:
        """Hand over request ``index``'s rows (``token_id``, ``request_index``, ``position``, points)."""
        self._raise_if_failed()
        self._queue.put((index, columns))

    def close(self) -> list[ShardEntry]:
        """Flush the last shard, stop the thread, re-raise any write error."""
        self._queue.put(_DONE)
        self._thread.join()
        self._raise_if_failed()
        return self.entries

    def abort(self) -> None:
        """Stop without flushing the partial shard (the run failed elsewhere)."""
        self._aborted = True
        self._queue.put(_DONE)
        self._thread.join(timeout=60)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _DONE:
                    if self._error is None and not self._aborted:
                        self._flush()
                    return
                if self._error is not None:
                    continue
                index, columns = item
                self._pending[index] = columns
                while self.next_index in self._pending:
                    cols = self._pending.pop(self.next_index)
                    self._buffer.append(cols)
                    self._buffer_rows += int(cols["position"].shape[0])
                    self.next_index += 1
                    if self._buffer_rows >= self.shard_tokens:
                        self._flush()
        except BaseException as exc:  # surfaced to the engine loop on its next put / close
            self._error = exc

    def _flush(self) -> None:
        if not self._buffer:
            return
        columns = {k: torch.cat([b[k] for b in self._buffer]) for k in self._buffer[0]}
        name = f"part{self.manifest.part:03d}-{self.seq:05d}{SUFFIX[self.fmt]}"
        size, digest = write_shard(self.manifest.out / name, columns, self.fmt)
        entry = ShardEntry(name, self.manifest.part, self.seq, self._buffer_rows,
                           [self._buffer_first, self.next_index], size, digest)
        self.manifest.append(entry)
        self.entries.append(entry)
        self.bytes_written += size
        self.rows_written += self._buffer_rows
        self.seq += 1
        self._buffer, self._buffer_first, self._buffer_rows = [], self.next_index, 0
