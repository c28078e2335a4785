"""Writing files atomically, with the permissions every other tool gives them.

A file (or a whole folder) is written beside its final name, fsynced, renamed into place,
and its parent folder fsynced, so a reader (or a rerun after ``kill -9``) sees either the old
file or the whole new one; every file tapllm writes goes through :func:`atomic_path`.
Library writers that create their own temporaries (``tempfile.mkstemp``, safetensors' Rust
writer) make them ``0600``; the finished file gets ``0666 & ~umask`` instead, as
``open(path, "w")`` would give it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where the platform allows."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no way to read it without setting it elsewhere
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """``0666 & ~umask``: the mode a plain ``open(path, "w")`` creates."""
    return 0o666 & ~current_umask()


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path_for(path: Path) -> Path:
    """A fresh hidden name beside ``path`` for its temporary (``.NAME.XXXXXXXX.tmp``)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


@contextmanager
def atomic_path(path: str | os.PathLike, *, folder: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; commit it on success.

    With ``folder=True`` the temporary is an empty folder to fill, committed as a whole. On a
    clean exit the temporary (every file in it, for a folder) is fsynced and given the default
    mode, renamed onto ``path`` and the parent folder fsynced. On an exception it is removed
    and ``path`` is untouched. ``FileNotFoundError`` names a missing parent folder.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: no such directory: {parent}")
    tmp = temp_path_for(path)
    try:
        if folder:
            tmp.mkdir()
        yield tmp
        _seal(tmp)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(parent)


def _seal(tmp: Path) -> None:
    """Make a finished temporary durable with the default mode (a folder's files first, then the folder)."""
    if tmp.is_dir():
        for child in sorted(tmp.iterdir()):
            _seal(child)
        fsync_dir(tmp)
        return
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, default_file_mode())


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[Path], None]) -> Path:
    """Write ``data`` (bytes, text, or a function that writes a given path) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        if callable(data):
            data(tmp)
        elif isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(path)
