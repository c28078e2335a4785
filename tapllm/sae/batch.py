"""The step's SAE work: per distinct SAE, the rows of every request reading it, encoded together, their
results in one int32 tensor (a group's *pack*) copied to the host once; each request keeps views of
its rows of that copy (:meth:`tapllm.sae.features.FeatureBuffers.take`), so nothing is done per request
while the step runs.

A pack row is one captured position, requests after one another in the group's order::

    [ids (kmax) | values (kmax) | error norm | dense latents]

``kmax`` is the group's largest top-k (a request's ids and values are the first k of those
columns); float numbers are stored as their float32 bits; the dense part holds every latent when a
request asks for ``"all"``, else the union of the listed ids.

Where the SAE and the requests allow it (top-k requests of a ``standard``, ``jumprelu`` or ``topk``
SAE without input normalization or decoder-norm rescaling) and the step runs Triton (the CUDA
backend), a group costs a fixed number of ops whatever its size: the gather of its rows, the input's
cast with ``b_dec``'s subtraction, one matmul with ``W_enc``, one kernel for the rest
(:mod:`tapllm.kernels.triton_sae`) and the copy. Otherwise the PyTorch encode
(:func:`tapllm.sae.encode.encode_and_reconstruct`) runs on the group's rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tapllm.kernels import triton_sae
from tapllm.sae.encode import encode_and_reconstruct
from tapllm.sae.features import Columns, FeatureSelection
from tapllm.sae.model import SAE

RowsOf = Callable[[Any, str, int], torch.Tensor]  # (entry, point, layer key) -> that entry's rows [n, ...]
# (entries, point, layer key) -> the entries' rows of that point, one entry after another: [rows, width]
Gather = Callable[[list[Any], str, int], torch.Tensor]


class FeatureBatch:
    """The step's SAE work (module docstring). ``entries`` have ``capture``, ``a`` and ``b`` (positions
    ``[a, b)``); ``kernel``: the step runs Triton, so the fused kernel may serve a group; ``layouts``: the
    groups' layouts kept from step to step (None: made anew)."""

    def __init__(self, entries: Sequence[Any], *, kernel: bool = False, layouts: PackLayouts | None = None) -> None:
        self.kernel = kernel
        self.layouts = layouts
        self.groups: dict[int, list[Any]] = {}
        for e in entries:
            fs = e.capture.sel.features
            if fs is not None:
                self.groups.setdefault(id(fs.sae), []).append(e)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def run(self, gather: Gather, sink: Any, skip: Any) -> dict[Any, str]:
        """Encode each group (its rows from ``gather``), hand each entry its rows; returns ``{capture: error}``
        for entries that failed."""
        failed: dict[Any, str] = {}
        for entries in self.groups.values():
            if skip:
                entries = [e for e in entries if e.capture not in skip]
            if not entries:
                continue
            try:
                sels: list[FeatureSelection] = [e.capture.sel.features for e in entries]
                fs = sels[0]
                x = gather(entries, fs.point, fs.key)
                target = gather(entries, *fs.out) if fs.out is not None else None
                layout = self.layouts.get(sels) if self.layouts is not None else PackLayout(sels)
                host = sink.host_copy(group_pack(fs.sae, sels, x, target, layout, self.kernel))
            except Exception as exc:  # noqa: BLE001 - the group's requests fail, the others go on
                for e in entries:
                    failed[e.capture] = f"hidden_states: computing SAE features failed: {type(exc).__name__}: {exc}"
                continue
            row = 0
            for e, cols in zip(entries, layout.columns):
                try:
                    e.capture.features.take(host, row, cols, e.a, e.b)
                except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                    failed[e.capture] = f"hidden_states: delivering SAE features failed: {type(exc).__name__}: {exc}"
                row += e.b - e.a
        return failed


def group_pack(sae: SAE, sels: list[FeatureSelection], x: torch.Tensor, target: torch.Tensor | None,
               layout: PackLayout, kernel: bool) -> torch.Tensor:
    """A group's pack of rows ``x`` (the device work): the fused kernel where it applies (``kernel``: the
    step runs Triton), else the PyTorch encode."""
    k = None
    if kernel and triton_sae.available(x.device):
        if layout.fused is _UNKNOWN:
            layout.fused = kernel_k(sae, sels)
        k = layout.fused
    if k is not None:
        return fused_pack(sae, x, target, k)
    return eager_pack(sae, x, target, layout)


def gather_each(rows_of: RowsOf) -> Gather:
    """A :data:`Gather` from each entry's rows: joined in one op (a copy for one entry too, so that a step's
    ops are the same at every batch size)."""
    def gather(entries: list[Any], point: str, key: int) -> torch.Tensor:
        return torch.cat([rows_of(e, point, key).reshape(e.b - e.a, -1) for e in entries])
    return gather


_UNKNOWN = object()


class PackLayout:
    """The columns of a group's pack (module docstring) and where each request's fields are in them."""

    def __init__(self, sels: Sequence[FeatureSelection]) -> None:
        self.sels = list(sels)
        self.fused: int | None | object = _UNKNOWN  # kernel_k of the group, once asked (group_pack)
        self.k = max((s.k for s in sels if s.mode == "topk"), default=0)
        self.all = any(s.mode == "all" for s in sels)
        lists = [s.ids.tolist() if s.mode == "ids" else [] for s in sels]
        self.listed = [] if self.all else sorted({i for ids in lists for i in ids})
        err, dense = 2 * self.k, 2 * self.k + 1
        place = {i: dense + n for n, i in enumerate(self.listed)}
        self.columns: list[Columns] = []
        for s, ids in zip(sels, lists):
            cols: Columns = {"error_norm": slice(err, err + 1)}
            if s.mode == "topk":
                cols.update(ids=slice(0, s.k), values=slice(self.k, self.k + s.k))
            elif s.mode == "all":
                cols["dense"] = slice(dense, dense + s.sae.d_sae)
            else:
                cols["dense"] = [dense + i for i in ids] if self.all else [place[i] for i in ids]
            self.columns.append(cols)


class PackLayouts:
    """Each SAE's :class:`PackLayout` of the last step, reused while its group's selections are the same
    objects (a decode loop meets the same group step after step); an SAE that a step did not use is
    forgotten at :meth:`end_step`, so no finished request's selection is held longer than a step."""

    def __init__(self) -> None:
        self._by_sae: dict[int, PackLayout] = {}
        self._used: set[int] = set()

    def get(self, sels: list[FeatureSelection]) -> PackLayout:
        """The layout of a group of ``sels`` (one SAE)."""
        key = id(sels[0].sae)
        self._used.add(key)
        layout = self._by_sae.get(key)
        if layout is None or len(layout.sels) != len(sels) or any(map(operator.is_not, layout.sels, sels)):
            layout = self._by_sae[key] = PackLayout(sels)
        return layout

    def end_step(self) -> None:
        """Forget the layouts of SAEs the step did not use."""
        if len(self._used) != len(self._by_sae):
            self._by_sae = {k: v for k, v in self._by_sae.items() if k in self._used}
        self._used.clear()


def kernel_k(sae: SAE, sels: Sequence[FeatureSelection]) -> int | None:
    """The top-k the fused kernel computes for ``sels`` (the largest), or None when it cannot serve them."""
    c = sae.cfg
    if any(s.mode != "topk" for s in sels) or c.normalize_activations != "none" or c.rescale_acts_by_decoder_norm:
        return None
    k = max(s.k for s in sels)
    if not triton_sae.fits(c.architecture, c.k, k) or sae.dtype != torch.float32:
        return None
    rows = [sae.W_dec, sae.b_dec] + ([sae.threshold] if sae.threshold is not None else [])
    return k if all(t.stride(-1) == 1 for t in rows) else None  # the kernel reads contiguous rows


def fused_pack(sae: SAE, x: torch.Tensor, target: torch.Tensor | None, k: int) -> torch.Tensor:
    """The pack of rows ``x`` (the model's dtype) through the fused kernel: ``[n, 2k + 1]`` (:func:`kernel_k`)."""
    c = sae.cfg
    x_in = x - sae.b_dec if c.apply_b_dec_to_input else x.float()  # float32 either way
    pre = torch.addmm(sae.b_enc, x_in, sae.W_enc)
    base = sae.b_dec[None] if sae.W_skip is None else torch.addmm(sae.b_dec, x.float(), sae.W_skip.T)
    return triton_sae.sae_features(pre, sae.W_dec, base, x if target is None else target, arch=c.architecture,
                                   k_out=k, k=c.k, threshold=sae.threshold)


def eager_pack(sae: SAE, x: torch.Tensor, target: torch.Tensor | None, layout: PackLayout) -> torch.Tensor:
    """The pack of rows ``x`` through the PyTorch encode (any SAE, any request)."""
    x = x.float()
    z, recon = encode_and_reconstruct(sae, x)
    err = ((x if target is None else target.float()) - recon).norm(dim=-1)
    parts = []
    if layout.k:
        top = torch.topk(z, layout.k, dim=-1)
        parts += [top.indices.to(torch.int32), top.values.view(torch.int32)]
    parts.append(err[:, None].view(torch.int32))
    if layout.all:
        parts.append(z.view(torch.int32))
    elif layout.listed:
        parts.append(z.index_select(1, torch.tensor(layout.listed, device=z.device)).view(torch.int32))
    return torch.cat(parts, dim=1)
