"""A spec resolved against the model and one request, and that request's capture buffers.

Rows are written by absolute position and a high-water mark (``next_pos``) records how far
capture has got, so a request that is preempted and recomputed, or whose prefix came from
the cache, ends with exactly one row per position.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from tapllm.hidden_states.reducers import Reducer, get_reducer
from tapllm.hidden_states.result import HiddenStates
from tapllm.hidden_states.lens import LensBuffers, LensFn
from tapllm.hidden_states.spec import (DTYPES, HIDDEN_POINTS, LENS_POINTS, PSEUDO_POINTS, QUERY_HEAD_POINTS,
                                       HiddenStatesSpec)
from tapllm.models.tap import PSEUDO_LAYER
from tapllm.sae.features import FeatureBuffers, FeatureSelection


@dataclass(slots=True)
class Selection:
    """What one request captures, resolved: points, block indices, positions, shapes, dtype."""

    points: tuple[str, ...]
    layers: tuple[int, ...]
    lo: int  # first position captured
    hi: int  # one past the last position the request can reach (an upper bound)
    last_only: bool  # positions="last": only the latest computed position is kept
    shapes: dict[str, tuple[int, ...]]  # per point, the shape of one layer's row (after heads / project)
    dtype: torch.dtype
    reduce: str | None
    lens_k: int = 0  # logit lens: top tokens kept per state (0: no lens)
    lens_targets: int = 0  # logit lens: target tokens reported per state
    heads: tuple[int, ...] | None = None  # query heads kept for q, z and attn_pattern (None: all)
    features: FeatureSelection | None = None  # SAE features (tapllm.sae.features), set by the engine

    def layer_keys(self, point: str) -> tuple[int, ...]:
        """The model's layer keys of ``point``: block indices, or the pseudo-layer."""
        return (PSEUDO_LAYER,) if point in PSEUDO_POINTS else self.layers

    def tap_points(self) -> tuple[str, ...]:
        """The points the step records for this request: the captured ones, then the SAE's inputs."""
        extra = [p for p, _ in self.features.inputs()] if self.features is not None else []
        return tuple(dict.fromkeys([*self.points, *extra]))

    def tap_keys(self, point: str) -> tuple[int, ...]:
        """The layer keys of ``point`` the step records: the captured layers, then the SAE's."""
        keys = self.layer_keys(point) if point in self.points else ()
        extra = [k for p, k in self.features.inputs() if p == point] if self.features is not None else []
        return tuple(dict.fromkeys([*keys, *extra]))

    @property
    def max_positions(self) -> int:
        """Most positions this request can capture."""
        return 1 if self.last_only else self.hi - self.lo

    def row_size(self, point: str) -> int:
        """Numbers in one position's row of ``point`` (all its layers)."""
        return len(self.layer_keys(point)) * math.prod(self.shapes[point])

    @property
    def max_bytes(self) -> int:
        """Upper bound on the bytes of the result."""
        rows = 1 if self.reduce else self.max_positions
        states = rows * sum(self.row_size(p) for p in self.points) * torch.tensor([], dtype=self.dtype).element_size()
        lens_layers = sum(len(self.layer_keys(p)) for p in self.points if p in LENS_POINTS)
        features = self.max_positions * self.features.row_bytes() if self.features is not None else 0
        return states + rows * lens_layers * (12 * self.lens_k + 4 * self.lens_targets) + features  # int64 ids, f32


def resolve(
    spec: HiddenStatesSpec,
    *,
    num_layers: int,
    hidden_size: int,
    model_dtype: torch.dtype,
    num_prompt: int,
    max_positions: int,
    encode: bool,
    vocab_size: int | None = None,
    point_shapes: dict[str, tuple[int, ...]] | None = None,
) -> Selection:
    """Check ``spec`` against the model and request; ``ValueError`` names the field.

    ``max_positions`` is how many positions the request can run through the model: the
    prompt for encode; the prompt plus up to ``max_tokens - 1`` generated tokens otherwise
    (the last sampled token is never run). ``point_shapes`` gives the model's row shape of
    the points inside attention and the MLP (``q``/``z`` ``(heads, head_dim)``, ``k``/``v``
    ``(kv_heads, head_dim)``, ``mlp_post`` ``(d_mlp,)``).
    """
    layers = _resolve_layers(spec.layers, num_layers)
    if all(p in PSEUDO_POINTS for p in spec.points):
        layers = ()  # only embed/final: no block index applies
    if spec.project is not None and spec.project.shape[1] != hidden_size:
        raise ValueError(
            f"hidden_states.project has width {spec.project.shape[1]}, "
            f"but the model's hidden size is {hidden_size}: it must be [k, {hidden_size}]"
        )
    p, end = num_prompt, max_positions
    what = "encode runs only the prompt" if encode else f"positions 0..{end - 1} can be computed"
    last_only = False
    if spec.positions == "prompt":
        lo, hi = 0, p
    elif spec.positions == "generated":
        lo, hi = p, end
        if lo >= hi:
            why = "encode generates no tokens" if encode else "with max_tokens=1 no generated token is run"
            raise ValueError(f"hidden_states.positions='generated' selects nothing: {why}")
    elif spec.positions == "all":
        lo, hi = 0, end
    elif spec.positions == "last_prompt":
        lo, hi = p - 1, p
    elif spec.positions == "last":
        lo, hi, last_only = p - 1, end, True
    else:
        lo, hi = spec.positions
        if hi > end:
            raise ValueError(
                f"hidden_states.positions: window [{lo}, {hi}) lies outside the sequence: {what} "
                f"(prompt of {p} tokens), so the window must end at or before {end}"
            )
    shapes, heads = _point_shapes(spec, hidden_size, point_shapes or {}, hi)
    dtype = DTYPES[spec.dtype] if spec.dtype else model_dtype
    targets = list(spec.lens_targets or ())
    if vocab_size is not None and any(t >= vocab_size for t in targets):
        raise ValueError(f"hidden_states.lens_targets: token ids must be in [0, {vocab_size}), got {targets}")
    return Selection(tuple(spec.points), layers, lo, hi, last_only, shapes, dtype, spec.reduce, spec.lens or 0,
                     len(targets), heads)


def _point_shapes(spec: HiddenStatesSpec, hidden: int, model_shapes: dict[str, tuple[int, ...]], hi: int
                  ) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...] | None]:
    """Each point's row shape, after the head selection and the projection."""
    heads = None
    if spec.heads is not None:
        n = model_shapes.get("q", (0,))[0]
        bad = [h for h in spec.heads if not -n <= h < n]
        if bad:
            raise ValueError(f"hidden_states.heads: head {bad[0]} is out of range for {n} query heads")
        heads = tuple(h % n for h in spec.heads)
        if len(set(heads)) != len(heads):
            raise ValueError(f"hidden_states.heads names a head twice: {list(spec.heads)}")
    shapes = {}
    for point in spec.points:
        if point in HIDDEN_POINTS:
            shapes[point] = (spec.project.shape[0],) if spec.project is not None else (hidden,)
            continue
        if spec.project is not None:
            raise ValueError(f"hidden_states.project applies to hidden-size points only, not {point!r}")
        if point == "attn_pattern":
            n = model_shapes["q"][0]
            shapes[point] = (len(heads) if heads is not None else n, hi)
        elif point not in model_shapes:
            raise ValueError(f"hidden_states.points: this model does not expose {point!r}")
        elif point in QUERY_HEAD_POINTS and heads is not None:
            shapes[point] = (len(heads), *model_shapes[point][1:])
        else:
            shapes[point] = model_shapes[point]
    return shapes, heads


def _resolve_layers(layers: list[int] | str, n: int) -> tuple[int, ...]:
    if layers == "all":
        return tuple(range(n))
    out = []
    for i in layers:
        if not -n <= i < n:
            raise ValueError(
                f"hidden_states.layers: layer {i} is out of range for a {n}-block model (valid: {-n}..{n - 1})"
            )
        out.append(i % n)
    if len(set(out)) != len(out):
        raise ValueError(f"hidden_states.layers names a block twice: {list(layers)} -> {out}")
    return tuple(out)


class RequestCapture:
    """One request's capture state: CPU buffers by absolute position, or on-device reducers."""

    def __init__(self, sel: Selection, spec: HiddenStatesSpec, num_prompt: int, device: torch.device,
                 lens_fn: LensFn | None = None) -> None:
        self.sel = sel
        self.spec_dict = spec.to_dict()
        self.device = device
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
        return torch.zeros(shape, dtype=self.sel.dtype) if point == "attn_pattern" else \
            torch.empty(shape, dtype=self.sel.dtype)

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
            tensors[point] = out.to("cpu", sel.dtype).contiguous()
        lens = None
        if self.lens is not None:
            lens = self.lens.of_reduced(reduced) if sel.reduce else self.lens.result(n)
        features = self.features.result(positions) if self.features is not None else None
        return HiddenStates(tensors, positions, list(sel.layers), sel.reduce, self.spec_dict, lens=lens,
                            features=features)


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
