"""The real server (``tapllm serve`` in a subprocess) for the HTTP tests, and raw HTTP helpers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from helpers import assert_close

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``tapllm serve`` in a subprocess, on a free loopback port.

    ``env`` adds environment variables; ``pythonpath`` entries go in front of the child's
    PYTHONPATH (e.g. a folder holding a reducer plugin's ``*.dist-info``).
    """

    def __init__(self, model: Path, *args: str, env: dict[str, str] | None = None,
                 pythonpath: list[str] | None = None, key: str | None = KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        cmd = [sys.executable, "-m", "tapllm", "serve", str(model), "--port", str(self.port), "--dtype", "float32",
               "--served-model-name", "tiny_llama", "--quiet", *args]
        child_env = {**os.environ, **(env or {})}
        if pythonpath:
            child_env["PYTHONPATH"] = os.pathsep.join([*pythonpath, child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tapllm-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=child_env)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()[-3000:]}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def request(self, method: str, path: str, body: bytes | None = None, key: str | None = "default",
                content_type: str | None = "application/json", timeout: float = 60) -> tuple[int, dict | str]:
        req = urllib.request.Request(self.url + path, data=body, method=method)
        if content_type:
            req.add_header("Content-Type", content_type)
        key = self.key if key == "default" else key
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def get(self, path: str, key: str | None = "default") -> tuple[int, dict | str]:
        return self.request("GET", path, None, key)

    def post(self, path: str, obj: dict | bytes, key: str | None = "default", **kw) -> tuple[int, dict | str]:
        return self.request("POST", path, obj if isinstance(obj, bytes) else json.dumps(obj).encode(), key, **kw)

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def rss_mb(self) -> float:
        """The server process's resident memory, in MB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key or "none", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def serving(model: Path, *args: str, **kw):
    """A fixture body: a running :class:`Server`, stopped when the fixture ends."""
    server = Server(model, *args, **kw)
    try:
        yield server
    finally:
        server.stop()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """``a`` equals ``b`` in dtype, shape, and value within 1e-5 of ``b``'s scale."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert_close(a, b)


def same_states(got, ref) -> None:
    """Two ``HiddenStates``: the same positions, layers and points, every tensor :func:`close`."""
    assert got is not None and ref is not None
    assert got.positions.tolist() == ref.positions.tolist() and got.layers == ref.layers
    assert got.points == ref.points
    for p in ref.points:
        close(got[p], ref[p])


def chat_equals_llm(client, reference, spec: dict, stream_states: bool) -> None:
    """A chat request through the chat template answers as ``reference.chat`` does (text and ``spec``'s
    states), and so does the same request streamed (its states too when ``stream_states``)."""
    from tapllm import HiddenStatesSpec, SamplingParams
    from tapllm.client import decode_hidden_states

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_ref = reference.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                       hidden_states=HiddenStatesSpec(**spec)), use_tqdm=False)[0]
    r = client.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "hidden_states": spec})
    assert r.choices[0].message.content == chat_ref.outputs[0].text
    same_states(decode_hidden_states(r.choices[0]), chat_ref.hidden_states)
    extra = {"ignore_eos": True, **({"hidden_states": spec} if stream_states else {})}
    stream = list(client.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=6,
                                                 temperature=0, stream=True, extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat_ref.outputs[0].text
    if stream_states:
        same_states(decode_hidden_states(stream[-1].choices[0]), chat_ref.hidden_states)
