"""Files a recipe writes for one group of a collection, made durable together.

Each file is written beside its name and renamed into place at once, so a reader never sees
half a file; :meth:`GroupFiles.commit` then syncs every file of the group and each of their
folders once, before the group's shard and manifest line are written. A rerun rewrites every
group its manifest does not list, so a group's files need to be durable only by the time the
group is listed: one sync per file, issued together, and one per folder, where syncing each
file and its folder as it is written costs two waits on the disk per file.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tapllm.utils.files import fsync_dir, temp_path_for
from tapllm.collect.shards import write_error

SYNC_THREADS = 16


class GroupFiles:
    """The files of one group: :meth:`write` each, then :meth:`commit` once."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def write(self, path: Path, data: bytes) -> None:
        """Put ``data`` at ``path`` (renamed into place; synced by :meth:`commit`). ``OSError`` names ``path``."""
        tmp = temp_path_for(path)
        try:
            with open(tmp, "wb") as f:  # the umask's mode, as open() gives any file
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_error(path, exc) from None
        self.paths.append(path)

    def commit(self) -> None:
        """Make every file written so far durable, then their folders (the renames).

        The files are synced from several threads at once: the file system then commits them in
        a few journal transactions rather than one each."""
        if self.paths:
            with ThreadPoolExecutor(max_workers=min(SYNC_THREADS, len(self.paths))) as pool:
                list(pool.map(_sync, self.paths))
        for folder in sorted({p.parent for p in self.paths}):
            fsync_dir(folder)
        self.paths.clear()


def _sync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise write_error(path, exc) from None
