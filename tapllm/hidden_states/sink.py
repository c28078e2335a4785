"""Moving captured rows from the model's device into the requests' buffers without stalling the device.

On CPU each write is one copy straight into the request's buffer. On CUDA (``staged``), a
step's writes to host buffers are queued; :meth:`CopySink.flush` packs them per dtype and
copies them to pinned host memory on a side stream, after the step's work, without
waiting; the rows reach the requests' buffers at :meth:`CopySink.settle`, which the next
step calls before it touches any buffer (so the copy overlaps that step's forward) and the
engine calls before it reads a finished request's states. The rows are packed on the main stream,
so they are read before the next step can overwrite what they came from (a graph step's capture
buffer), and only the packed copy is read on the side stream; it stays referenced until its copy is
done (the main stream's allocator would otherwise hand its memory to the next step). A write whose buffer lives on the device itself
(``HiddenStatesSpec(device="cuda")``) is a device copy, made at once.

A graph step copies its whole capture buffer's used part to the host at once and hands requests
views of it, as the SAE work does with each SAE's results (:meth:`CopySink.host_copy`);
:meth:`CopySink.track` makes :meth:`settle` wait for those copies too.
"""

from __future__ import annotations

import torch


class CopySink:
    """Moves captured rows into the requests' buffers (see the module docstring)."""

    def __init__(self, staged: bool) -> None:
        self.staged = staged
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._host: list[dict[torch.dtype, torch.Tensor]] = [{}, {}]  # two pinned sets: one in flight, one filling
        self._turn = 0
        # (pinned set, done, (dest, host) pairs to scatter, tensors kept alive until done)
        self._inflight: list[tuple[int, torch.cuda.Event, list[tuple[torch.Tensor, torch.Tensor]], list]] = []
        self._stream: torch.cuda.Stream | None = None

    def write(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dest`` (now, or from :meth:`settle` on when it crosses to the host)."""
        if not self.staged or dest.device == src.device:
            dest.copy_(src)
        else:
            self.pending.append((dest, src.to(dest.dtype)))

    def track(self, host: torch.Tensor, src: torch.Tensor) -> None:
        """Wait at :meth:`settle` for an asynchronous copy of ``src`` into ``host`` issued on the current stream."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(src.device))
        self._inflight.append((-1, done, [], [src, host]))

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host, for requests to keep views of: ``t`` itself when it is there already (the caller
        copies what it reuses), else a pinned copy; made asynchronously when staged (:meth:`settle` waits)."""
        if t.device.type == "cpu":
            return t
        if not self.staged:
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        self.track(host, t)
        return host

    def flush(self) -> None:
        """Start the queued copies to the host (a no-op unless staged)."""
        if not self.pending:
            return
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dest, src in self.pending:
            by_dtype.setdefault(dest.dtype, []).append((dest, src))
        sources = [src for _, src in self.pending]
        self.pending = []
        device = next(iter(by_dtype.values()))[0][1].device
        if device.type != "cuda":  # staged without a GPU (tests): the same bookkeeping, copied at once
            for pairs in by_dtype.values():
                for dest, src in pairs:
                    dest.copy_(src)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        turn, self._turn = self._turn, self._turn ^ 1
        if any(t == turn for t, _, _, _ in self._inflight):  # its pinned set is still being read: finish first
            self.settle()
        hosts = self._host[turn]
        scatter: list[tuple[torch.Tensor, torch.Tensor]] = []
        flats = {dtype: torch.cat([src.reshape(-1) for _, src in pairs]) for dtype, pairs in by_dtype.items()}
        sources += flats.values()
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            for dtype, pairs in by_dtype.items():
                flat = flats[dtype]
                host = hosts.get(dtype)
                if host is None or host.numel() < flat.numel():
                    host = torch.empty(max(flat.numel(), 2 * (host.numel() if host is not None else 0)),
                                       dtype=dtype, pin_memory=True)
                    hosts[dtype] = host
                host = host[: flat.numel()]
                host.copy_(flat, non_blocking=True)
                offset = 0
                for dest, _ in pairs:
                    n = dest.numel()
                    scatter.append((dest, host[offset : offset + n].view(dest.shape)))
                    offset += n
            done = torch.cuda.Event()
            done.record(self._stream)
        self._inflight.append((turn, done, scatter, sources))

    def settle(self) -> None:
        """Wait for the copies started by :meth:`flush` and :meth:`track` and put their rows in the requests' buffers."""
        if not self._inflight:
            return
        inflight, self._inflight = self._inflight, []
        with torch.inference_mode():  # buffers grown during a step are inference tensors
            for _, done, scatter, _ in inflight:
                done.synchronize()
                for dest, host in scatter:
                    dest.copy_(host)
