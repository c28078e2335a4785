"""Moving captured rows from the model's device into the requests' CPU buffers."""

from __future__ import annotations

import torch


class CopySink:
    """Moves captured rows into CPU buffers.

    On CPU each write is one copy straight into the request's buffer. With ``staged`` (used
    on CUDA), writes are queued and ``flush`` sends all of a step's rows to the host in one
    asynchronous copy per dtype into pinned memory, then scatters them into the buffers.
    """

    def __init__(self, staged: bool) -> None:
        self.staged = staged
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._host: dict[torch.dtype, torch.Tensor] = {}  # reused: pinned allocation is slow

    def write(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into the CPU tensor ``dest`` (now, or at ``flush``)."""
        if not self.staged:
            dest.copy_(src)
        else:
            self.pending.append((dest, src.to(dest.dtype)))

    def flush(self) -> None:
        """Finish the queued copies (a no-op unless staged)."""
        if not self.pending:
            return
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dest, src in self.pending:
            by_dtype.setdefault(dest.dtype, []).append((dest, src))
        self.pending = []
        for dtype, pairs in by_dtype.items():
            flat = torch.cat([src.reshape(-1) for _, src in pairs])
            pin = flat.device.type == "cuda"
            host = self._host.get(dtype)
            if host is None or host.numel() < flat.numel():
                host = torch.empty(max(flat.numel(), 2 * (host.numel() if host is not None else 0)),
                                   dtype=dtype, pin_memory=pin)
                self._host[dtype] = host
            host = host[: flat.numel()]
            host.copy_(flat, non_blocking=pin)
            if pin:
                torch.cuda.current_stream(flat.device).synchronize()
            offset = 0
            for dest, _ in pairs:
                n = dest.numel()
                dest.copy_(host[offset : offset + n].view(dest.shape))
                offset += n
