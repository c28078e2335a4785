"""``tapllm serve`` refuses a busy port, a missing file or a bad SAE entry before it loads anything:
the command exits with status 2 and a message naming the flag, without having imported torch."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _serve(*args: str) -> tuple[subprocess.CompletedProcess, float, bool]:
    """Run ``tapllm serve ARGS``; (the process, its seconds, whether it imported torch)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tapllm", "serve", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - t0
    torch = any(re.search(r"\|\s+torch$", line) for line in proc.stderr.splitlines())
    return proc, seconds, torch


def _error(proc: subprocess.CompletedProcess) -> str:
    return "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))


def test_a_busy_port_is_refused_before_anything_loads():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc, seconds, torch = _serve("--port", str(port))
    assert proc.returncode == 2
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in _error(proc)
    assert not torch  # refused before torch (a second of the start) was imported
    assert seconds < 10  # well under a second on an idle machine; generous for a loaded one


@pytest.mark.parametrize("args,message", [
    (["/no/such/model"], "model: no such file or folder: /no/such/model"),
    (["--chat-template", "missing-template.jinja"], "chat_template: no such file: missing-template.jinja"),
    (["--chat-template", "{% for m in messages %}"], "chat_template: the template is not a valid Jinja template"),
    (["--tokenizer", "./no/such/tokenizer"], "--tokenizer: no such file or folder: ./no/such/tokenizer"),
    (["--sae", "noequals"], "--sae: expected NAME=PATH, got 'noequals'"),
    (["--sae", "a=/no/such/sae"], "--sae a: no such file or folder: /no/such/sae"),
    (["--api-key-file", "/no/such/key"], "--api-key-file: cannot read /no/such/key"),
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--max-connections", "0"], "--max-connections must be >= 1, got 0"),
    (["--max-connections-per-client", "0"], "--max-connections-per-client must be >= 1, got 0"),
])
def test_a_bad_flag_or_file_is_refused_before_anything_loads(args, message):
    proc, _, torch = _serve(*args)
    assert proc.returncode == 2 and message in _error(proc), _error(proc)[-2000:]
    assert not torch


def test_an_sae_name_given_twice_is_refused(tmp_path):
    proc, _, torch = _serve("--sae", f"a={tmp_path}", "--sae", f"a={tmp_path}")
    assert proc.returncode == 2 and "--sae: the name 'a' is given twice" in _error(proc)
    assert not torch


def test_the_reserved_port_keeps_a_second_server_off_while_the_first_loads():
    from tapllm.cli.preflight import reserve_port

    sock = reserve_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(OSError, match="already in use"):
            reserve_port("127.0.0.1", port)
        proc, _, torch = _serve("--port", str(port))
        assert proc.returncode == 2 and "already in use" in _error(proc) and not torch
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # waits in the backlog meanwhile
    finally:
        sock.close()
