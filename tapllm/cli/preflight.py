"""What ``tapllm serve`` checks before it loads anything: the port, the SAE entries, every file it was given.

Loading a model takes seconds; a second server on a busy port, a misspelt file or a duplicate SAE
name must fail before that, within a fraction of a second of the command. Nothing here imports
torch. The listening socket is opened now, as vLLM opens its own before its engine starts: a
socket that is only bound would not keep a second server (which also sets ``SO_REUSEADDR``) off
the port, as Linux lets such sockets share a port until one listens. A client that connects
while the model loads waits in the backlog and is answered once the server is up.
"""

from __future__ import annotations

import argparse
import errno
import socket
from pathlib import Path

from tapllm.engine.chat import load_chat_template
from tapllm.loader.hub import looks_like_repo_id

_BACKLOG = 2048  # uvicorn's default


def reserve_port(host: str, port: int) -> socket.socket:
    """The server's listening socket on ``host:port``; ``OSError`` saying why it cannot be had."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(f"--port {port}: {host}:{port} is already in use (another server is listening there; "
                          "stop it or choose another --port)") from None
        raise OSError(f"--host {host} --port {port}: cannot bind: {exc.strerror or exc}") from None
    sock.set_inheritable(True)  # API server processes accept on it (--api-server-count)
    return sock


def parse_sae_entries(entries: list[str]) -> list[tuple[str, str]]:
    """``--sae NAME=PATH`` entries as ``(name, path)``: names unique, paths present (or hub ids)."""
    seen: set[str] = set()
    parsed = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--sae: expected NAME=PATH, got {entry!r}")
        if name in seen:
            raise ValueError(f"--sae: the name {name!r} is given twice")
        seen.add(name)
        check_path_or_repo(path, f"--sae {name}", repo_parts=None)
        parsed.append((name, path))
    return parsed


def check_path_or_repo(value: str, flag: str, repo_parts: int | None = 2) -> None:
    """``FileNotFoundError`` naming ``flag`` unless ``value`` exists or has the form of a Hub id
    (``org/name``; an SAE's may go on into a folder of the repository: ``repo_parts=None``)."""
    if Path(value).expanduser().exists():
        return
    parts = value.split("/")
    repo = "/".join(parts[:2]) if repo_parts is None else value
    if value.startswith((".", "/", "~")) or (repo_parts is None and len(parts) < 2) or not looks_like_repo_id(repo):
        raise FileNotFoundError(f"{flag}: no such file or folder: {value}")


def check_serve_files(args: argparse.Namespace, model: str | None) -> None:
    """Every file or folder the flags name, before the model loads (``FileNotFoundError``/``ValueError``)."""
    if model is not None:
        check_path_or_repo(model, "model")
        path = Path(model).expanduser()
        if path.is_file() and path.suffix != ".gguf":
            raise ValueError(f"model: a file must be a .gguf checkpoint, got {path}")
        if path.is_dir() and not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {path} has no config.json")
    if args.tokenizer is not None:
        check_path_or_repo(args.tokenizer, "--tokenizer")
    if args.chat_template is not None:
        load_chat_template(args.chat_template)  # a missing file or a template that does not parse
    if args.download_dir is not None and Path(args.download_dir).expanduser().is_file():
        raise ValueError(f"--download-dir: {args.download_dir} is a file, not a folder")
