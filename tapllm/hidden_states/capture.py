"""One request's capture buffers: CPU rows by absolute position, or on-device reducers.

Rows are written by absolute position and a high-water mark (``next_pos``) records how far
capture has got, so a request that is preempted and recomputed, or whose prefix came from
the cache, ends with exactly one row per position.
"""

from __future__ import annotations

import copy
import math

import torch

from tapllm.hidden_states.lens import LensBuffers, LensFn
from tapllm.hidden_states.reducers import Reducer, get_reducer
from tapllm.hidden_states.resolved import Selection
from tapllm.hidden_states.result import HiddenStates
from tapllm.hidden_states.sink import CopySink
from tapllm.hidden_states.spec import QUERY_HEAD_POINTS, HiddenStatesSpec
from tapllm.sae.features import FeatureBuffers


class RequestCapture:
    """One request's capture state: CPU buffers by absolute position, or on-device reducers."""

    def __init__(self, sel: Selection, spec: HiddenStatesSpec, num_prompt: int, device: torch.device,
                 lens_fn: LensFn | None = None) -> None:
        self.sel = sel
        self.spec_dict = spec.to_dict()
        self.device = device
        # where the result lives: the host, or the model's device (HiddenStatesSpec.device)
        self.out_device = torch.device(spec.device) if spec.device is not None else torch.device("cpu")
        self.next_pos = 0  # every position below this has been captured (or is not selected)
        self.last_pos = -1  # positions="last": the position held in the one-row buffer
        self.proj = spec.project.to(device) if spec.project is not None else None
        self.heads = torch.tensor(sel.heads, device=device) if sel.heads is not None else None
        self.reducers: dict[str, Reducer] | None = None
        if sel.reduce and not sel.last_only:
            self.reducers = {p: self._new_reducer(p) for p in sel.points}
        self.buffers: dict[str, torch.Tensor] = {}
        if self.reducers is None:
            if sel.last_only:
                cap = 1
            elif sel.lo < num_prompt:
                cap = min(sel.hi, num_prompt) - sel.lo  # prompt rows are known up front
            else:
                cap = min(sel.hi - sel.lo, 16)  # generated rows grow by doubling
            self.buffers = {p: self._empty(p, cap) for p in sel.points}
        self.lens: LensBuffers | None = None
        if sel.lens_k:
            if lens_fn is None:
                raise ValueError("hidden_states.lens: this model gives no lens function")
            layers = {p: len(sel.layer_keys(p)) for p in sel.points}
            self.lens = LensBuffers(sel.points, layers, sel.lens_k, spec.lens_targets, lens_fn, device)
        self.features = (FeatureBuffers(sel.features, sel.lo, sel.hi, sel.last_only, num_prompt)
                         if sel.features is not None else None)

    def _new_reducer(self, point: str) -> Reducer:
        r = get_reducer(self.sel.reduce)()
        r.start(len(self.sel.layer_keys(point)), math.prod(self.sel.shapes[point]), self.device)
        return r

    def _empty(self, point: str, rows: int) -> torch.Tensor:
        shape = (rows, len(self.sel.layer_keys(point)), *self.sel.shapes[point])
        # attention patterns leave the keys past each row's position zero: allocate zeros
        if point == "attn_pattern":
            return torch.zeros(shape, dtype=self.sel.dtype, device=self.out_device)
        return torch.empty(shape, dtype=self.sel.dtype, device=self.out_device)

    def first_needed(self, num_tokens: int) -> int:
        """The first position this request still has to run to capture what it asked for."""
        if self.sel.last_only:
            return num_tokens - 1
        pos = max(self.sel.lo, self.next_pos)
        return pos if pos < self.sel.hi else num_tokens

    def window(self, start: int, num_tokens: int) -> tuple[int, int] | None:
        """Positions ``[a, b)`` to capture from a chunk running ``[start, start + num_tokens)``."""
        end = start + num_tokens
        if self.sel.last_only:
            return (end - 1, end) if end - 1 >= max(self.sel.lo, self.next_pos) else None
        a, b = max(start, self.sel.lo, self.next_pos), min(end, self.sel.hi)
        return (a, b) if a < b else None

    def consume(self, point: str, rows: torch.Tensor, a: int, b: int, sink: CopySink) -> None:
        """Take the rows ``[b - a, layers, *shape]`` (device, model dtype) of positions ``[a, b)``.

        Per-head points arrive with every head; the request's ``heads`` are kept here.
        An ``attn_pattern`` row holds the keys the step computed; the rest stay zero.
        """
        if self.lens is not None and self.reducers is None:  # a reduction's lens comes at the end
            self.lens.consume(point, rows[-1:] if self.sel.last_only else rows,
                              0 if self.sel.last_only else a - self.sel.lo)
        if self.heads is not None and point in QUERY_HEAD_POINTS:
            rows = rows.index_select(2, self.heads)
        if self.proj is not None:
            rows = rows.float() @ self.proj.T
        if point == "attn_pattern" and rows.shape[-1] < self.sel.shapes[point][-1]:
            rows = torch.nn.functional.pad(rows, (0, self.sel.shapes[point][-1] - rows.shape[-1]))
        if self.reducers is not None:
            positions = torch.arange(a, b, device=rows.device)
            self.reducers[point].update(rows.float().reshape(*rows.shape[:2], -1), positions)
            return
        if self.sel.last_only:
            sink.write(self.buffers[point], rows[-1:])
            return
        buf = self.buffers[point]
        need = b - self.sel.lo
        if need > buf.shape[0]:
            grown = self._empty(point, min(max(need, 2 * buf.shape[0]), self.sel.hi - self.sel.lo))
            grown[: buf.shape[0]].copy_(buf)
            self.buffers[point] = buf = grown
        sink.write(buf[a - self.sel.lo : need], rows)

    def advance(self, a: int, b: int) -> None:
        """Record that positions ``[a, b)`` were captured this step."""
        self.next_pos = max(self.next_pos, b)
        if self.sel.last_only:
            self.last_pos = b - 1

    def fork(self) -> RequestCapture:
        """An independent copy of this capture's state (buffers, reducers, lens), for another sample
        that continues from the same positions: what was captured so far is captured once, and copied.

        Read-only parts (the projection, head indices, the model's lens function) stay shared.
        """
        shared = [self.sel, self.sel.features, self.proj, self.heads, self.device]  # the device SAE: shared
        if self.lens is not None:
            shared += [self.lens.fn, self.lens.targets]
        memo = {id(obj): obj for obj in shared if obj is not None}
        return copy.deepcopy(self, memo)

    def result(self) -> HiddenStates:
        """The request's ``HiddenStates`` (call once it has finished)."""
        sel = self.sel
        if sel.last_only:
            positions = torch.tensor([self.last_pos] if self.last_pos >= 0 else [], dtype=torch.long)
            n = len(positions)
        else:
            n = max(0, self.next_pos - sel.lo)
            positions = torch.arange(sel.lo, sel.lo + n, dtype=torch.long)
        tensors: dict[str, torch.Tensor] = {}
        reduced: dict[str, torch.Tensor] = {}
        for point in sel.points:
            layers, shape = len(sel.layer_keys(point)), sel.shapes[point]
            if self.reducers is not None:
                out = reduced[point] = self.reducers[point].finish()
            elif sel.reduce:  # positions="last" with a reduction: reduce the one kept row
                r = self._new_reducer(point)
                if n:
                    r.update(self.buffers[point][:n].float().reshape(n, layers, -1), positions)
                out = reduced[point] = r.finish()
            else:
                buf = self.buffers[point]
                out = buf[:n].clone() if n < buf.shape[0] else buf
            if sel.reduce and out.dim() == 2 and len(shape) > 1:  # [layers, prod(shape)] -> [layers, *shape]
                out = out.reshape(layers, *shape)
            if point == "attn_pattern" and not sel.reduce:  # keys 0..last captured position
                out = out[..., : int(positions[-1]) + 1 if n else 0]
            tensors[point] = out.to(self.out_device, sel.dtype).contiguous()
        lens = None
        if self.lens is not None:
            lens = self.lens.of_reduced(reduced) if sel.reduce else self.lens.result(n)
        features = self.features.result(positions) if self.features is not None else None
        return HiddenStates(tensors, positions, list(sel.layers), sel.reduce, self.spec_dict, lens=lens,
                            features=features)
