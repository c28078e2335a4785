"""One run at a time per output folder: an exclusive ``flock`` on ``--out/collect.lock``.

The driver takes the lock before it looks at the folder and holds it until the run ends
(with Ray too: the actors write only while the driver runs). The kernel drops it when the
holder exits, however it exits (``kill -9`` included), so a stale lock never blocks a rerun.
The file stays in the folder; while held it names the holder (pid and host), which a
refused run reports. On NFS, Linux implements ``flock`` with POSIX locks, so the lock also
holds between the machines of a cluster that mount the folder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = "collect.lock"


class OutputBusyError(RuntimeError):
    """Another run holds the output folder's lock."""


class OutputLock:
    """Hold ``out/collect.lock`` exclusively (``with OutputLock(out):``); fails at once if taken."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``OutputBusyError`` naming the folder and the holder."""
        # Not inherited by child processes (os.open's default): a Ray head started here must
        # not keep the folder locked after this process has gone.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f" (pid {holder})" if holder else ""
                raise OutputBusyError(
                    f"--out {self.out} is in use by another tapllm collect run{who}; wait for it to "
                    "finish or choose another folder"
                ) from None
            raise OSError(exc.errno, f"cannot lock {self.path}: {exc.strerror}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # the pid is a courtesy to a refused run; the lock itself is held
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (clearing the holder's name first)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
