"""A step's inputs in one buffer, sent to the device in one copy; its results back in one copy.

The runner writes everything a step needs from the host (token ids, positions, cache slots,
block-table diffs, context lengths, sampling parameters, the draws' uniforms) into sections of
one host buffer (pinned on CUDA, written through NumPy views), then :meth:`Staging.upload`
copies the used bytes to the device buffer in one transfer and hands back a device view per
section. Nothing else in a step goes from host to device unless a request asks for a
feature that needs it (capture and steering plans, logits controls, grammar masks). A step
replayed from a CUDA graph copies its section into the graph's own input buffer on the device.

:class:`Download` is the other direction: one device tensor of results copied into a
reused host buffer (pinned on CUDA), the one device-to-host copy a step waits for.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 8  # every section starts at a multiple of the widest element
_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
       torch.bool: np.bool_}
_SIZE = {dtype: np.dtype(t).itemsize for dtype, t in _NP.items()}


class Staging:
    """The step's host-to-device inputs (see the module docstring)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._sections: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []
        self._used = 0
        self._done: torch.cuda.Event | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self._pinned)
        self._host_np = self.host.numpy()
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)

    def begin(self) -> None:
        """Start a step's sections (the host buffer is free once the previous upload has been read)."""
        self._wait()
        self._sections.clear()
        self._used = 0

    def add(self, values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype,
            shape: tuple[int, ...] | None = None) -> int:
        """Write ``values`` (flattened, as ``dtype``) into a new section; returns its index in :meth:`upload`'s list."""
        arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=_NP[dtype])
        n = arr.size
        size = n * _SIZE[dtype]
        start = -(-self._used // _ALIGN) * _ALIGN
        if start + size > self.host.numel():
            self._grow(start + size)
        self._host_np[start:start + size].view(_NP[dtype])[:] = arr.reshape(-1)
        self._sections.append((start, n, dtype, shape if shape is not None else (n,)))
        self._used = start + size
        return len(self._sections) - 1

    def zeros(self, n: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> tuple[int, np.ndarray]:
        """A new zero-filled section of ``n`` elements: its index and its host array, to fill in place
        before the next section is added."""
        size = n * _SIZE[dtype]
        start = -(-self._used // _ALIGN) * _ALIGN
        if start + size > self.host.numel():
            self._grow(start + size)
        view = self._host_np[start:start + size].view(_NP[dtype])
        view[:] = 0
        self._sections.append((start, n, dtype, shape if shape is not None else (n,)))
        self._used = start + size
        return len(self._sections) - 1, (view if shape is None else view.reshape(shape))

    def host_tensor(self, n: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """Like :meth:`zeros`, the host part as a tensor (to write with ``out=``)."""
        index, array = self.zeros(n, dtype)
        return index, torch.from_numpy(array)

    def _grow(self, need: int) -> None:
        """More host room mid-step: earlier sections are kept (the device buffer follows at upload)."""
        old = self._host_np[: self._used].copy()
        self._wait()
        capacity = max(need, 2 * self.host.numel())
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self._pinned)
        self._host_np = self.host.numpy()
        self._host_np[: len(old)] = old

    def upload(self) -> list[torch.Tensor]:
        """Copy the step's sections to the device in one transfer; the device view of each, in order."""
        used = self._used
        if used > self.buffer.numel():
            self.buffer = torch.empty(self.host.numel(), dtype=torch.uint8, device=self.device)
        if used:
            self.buffer[:used].copy_(self.host[:used], non_blocking=self._pinned)
        if self._pinned:
            self._done = torch.cuda.Event()
            self._done.record()
        return [self.buffer[start:start + n * _SIZE[dtype]].view(dtype).view(shape)
                for start, n, dtype, shape in self._sections]

    def _wait(self) -> None:
        if self._done is not None:  # the previous copy must have read the host buffer before it is rewritten
            self._done.synchronize()
            self._done = None


class PendingDownload:
    """Results on their way to the host (see :meth:`Download.start`)."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self.host = host
        self.done = done

    def result(self) -> np.ndarray:
        """The results, once the copy has finished (waits for it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()


class Download:
    """A step's results copied back into reused host buffers (pinned on CUDA): three per dtype in turn,
    so a step's results may still be on their way while the next step's are started."""

    RING = 3

    def __init__(self, device: torch.device) -> None:
        self._pinned = device.type == "cuda"
        self._host: dict[torch.dtype, list[torch.Tensor]] = {}
        self._turn = 0

    def _buffer(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        ring = self._host.setdefault(dtype, [])
        self._turn = (self._turn + 1) % self.RING
        while len(ring) <= self._turn:
            ring.append(torch.empty(0, dtype=dtype))
        host = ring[self._turn]
        if host.numel() < n:
            host = ring[self._turn] = torch.empty(max(n, 256, 2 * host.numel()), dtype=dtype, pin_memory=self._pinned)
        return host[:n]

    def fetch(self, values: torch.Tensor) -> np.ndarray:
        """``values`` (1-D, on the device) as a host array: one copy, waited for."""
        return self.start(values).result()

    def start(self, values: torch.Tensor) -> PendingDownload:
        """Start copying ``values`` (1-D, on the device) to the host without waiting (read it with
        :meth:`PendingDownload.result`): the copy waits for the work queued before it, so the host may
        prepare the next step meanwhile."""
        out = self._buffer(values.dtype, values.numel())
        out.copy_(values, non_blocking=self._pinned)
        done = None
        if self._pinned:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(values.device))
        return PendingDownload(out, done)
