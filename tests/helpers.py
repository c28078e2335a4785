"""Small helpers the tests share: tensor closeness, greedy sampling parameters, steering hooks."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tapllm import SamplingParams, Steer


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    """``a`` equals ``b`` in shape, and in value within ``tol`` of ``b``'s scale (at least 1)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert float((a.float() - b.float()).abs().max()) <= tol * max(1.0, float(b.float().abs().max()))


def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored), with any other ``fields``."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


class SteeringHooks:
    """What transformers-side steering hooks share: the position the current forward starts at,
    each steer's operation on a ``[batch, positions, hidden]`` tensor, and removing the hooks.

    A subclass registers its hooks (in ``handles``) where its model applies each steer.
    """

    def __init__(self, num_prompt: int) -> None:
        self.start = 0  # absolute position of the first row of the current forward
        self.num_prompt = num_prompt
        self.handles: list[Any] = []

    def _op(self, s: Steer, v: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``s``'s add or ablate of ``v``, on the positions it selects."""
        def apply(x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(self.start, self.start + x.shape[1], device=x.device)
            mask = {"all": torch.ones_like(pos, dtype=torch.bool), "prompt": pos < self.num_prompt,
                    "generated": pos >= self.num_prompt}[s.positions][None, :, None]
            if s.op == "add":
                new = x + s.scale * v.to(x.device, x.dtype)
            else:
                d = (v / v.norm()).to(x.device, x.dtype)
                new = x - (x @ d)[..., None] * d
            return torch.where(mask, new, x)
        return apply

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def kill_once_written(cmd: list[str], manifest: Path, lines: int, timeout: float = 120.0) -> None:
    """Run ``cmd`` (a ``tapllm collect``) and SIGKILL it once ``manifest`` holds ``lines`` lines, as
    a crash mid-run would; fails if the run ends first."""
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if manifest.exists() and len(manifest.read_text().splitlines()) >= lines:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def same_states(a: Any, b: Any, what: str) -> None:
    """Two requests' hidden states are the same bits (points, layers, positions, lens)."""
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.points == b.points and a.layers == b.layers, what
    assert torch.equal(torch.as_tensor(a.positions), torch.as_tensor(b.positions)), what
    for point in a.points:
        assert a[point].dtype == b[point].dtype and torch.equal(a[point], b[point]), f"{what}: {point} differs"
    if a.lens is not None:
        for point in a.lens:
            la, lb = a.lens[point], b.lens[point]
            assert torch.equal(la.token_ids, lb.token_ids) and torch.equal(la.logprobs, lb.logprobs), what


def same_alone_and_together(alone: Any, together: Any, what: str) -> None:
    """A request's output alone and in a batch are the same bits: tokens, logprobs, states."""
    assert alone.error is None and together.error is None, (alone.error, together.error)
    assert alone.prompt_logprobs == together.prompt_logprobs, f"{what}: prompt logprobs"
    same_states(alone.hidden_states, together.hidden_states, what)
    assert len(alone.outputs) == len(together.outputs)
    for i, (a, b) in enumerate(zip(alone.outputs, together.outputs)):
        assert a.token_ids == b.token_ids, f"{what}, sample {i}: tokens"
        assert a.logprobs == b.logprobs, f"{what}, sample {i}: logprobs"
        assert a.cumulative_logprob == b.cumulative_logprob, f"{what}, sample {i}"
        same_states(a.hidden_states, b.hidden_states, f"{what}, sample {i}")
