"""A ``tapllm serve`` of this checkout for the serving benchmarks: a free port, and a start that
returns once ``/health`` answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(serve_args: list[str], port: int, timeout: float = 300.0) -> subprocess.Popen:
    """``python -m tapllm serve --port PORT *serve_args``, once healthy; ``RuntimeError`` if it exits or
    does not answer within ``timeout`` seconds."""
    proc = subprocess.Popen([sys.executable, "-m", "tapllm", "serve", "--port", str(port), *serve_args], cwd=REPO_ROOT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy")
