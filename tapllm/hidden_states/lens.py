"""The logit lens: what the model would predict from each captured residual-stream state.

For a spec with ``lens=k``, every captured state of a residual-stream point goes through the
model's final norm and unembedding (``final`` states are already normed) on the model's
device, in slices; only the top ``k`` token ids and logprobs (and the logprobs of
``lens_targets``) are kept, so nothing of vocabulary size reaches the CPU. The result,
``hs.lens``, maps each such point to a :class:`LensResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from tapllm.hidden_states.spec import LENS_POINTS

# (point, states [rows, hidden]) -> logits [rows, vocab]: the model's final norm (unless the
# point is "final") and unembedding.
LensFn = Callable[[str, torch.Tensor], torch.Tensor]
_SLICE = 512  # states whose full-vocabulary logits exist at once


@dataclass(slots=True)
class LensResult:
    """One point's lens: ``token_ids``/``logprobs`` ``[positions, layers, k]`` (most likely first) and
    ``target_logprobs`` ``[positions, layers, targets]`` (``None`` without ``lens_targets``); without
    the positions dimension when the states were reduced."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    target_logprobs: torch.Tensor | None = None


class Lens(Mapping[str, LensResult]):
    """``hs.lens``: a :class:`LensResult` per residual-stream point; with one point, its fields too."""

    def __init__(self, results: dict[str, LensResult], targets: list[int] | None) -> None:
        self._results = results
        self.targets = targets

    def __getitem__(self, point: str) -> LensResult:
        try:
            return self._results[point]
        except KeyError:
            raise KeyError(f"no lens for point {point!r}; lens points: {list(self._results)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    def _only(self) -> LensResult:
        if len(self._results) != 1:
            raise AttributeError(f"the lens covers several points {list(self._results)}: use hs.lens[point]")
        return next(iter(self._results.values()))

    @property
    def token_ids(self) -> torch.Tensor:
        """The top token ids of the only lens point."""
        return self._only().token_ids

    @property
    def logprobs(self) -> torch.Tensor:
        """Their logprobs."""
        return self._only().logprobs

    @property
    def target_logprobs(self) -> torch.Tensor | None:
        """The logprobs of ``lens_targets``."""
        return self._only().target_logprobs


def lens_of(states: torch.Tensor, point: str, k: int, targets: torch.Tensor | None, fn: LensFn
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Top ``k`` ids and logprobs (and the targets' logprobs) of states ``[..., hidden]``, on their device."""
    shape = states.shape[:-1]
    flat = states.reshape(-1, states.shape[-1])
    ids, lps, tgt = [], [], []
    for lo in range(0, flat.shape[0], _SLICE):
        lp = fn(point, flat[lo : lo + _SLICE]).float().log_softmax(-1)
        vals, idx = lp.topk(k, dim=-1)
        ids.append(idx)
        lps.append(vals)
        if targets is not None:
            tgt.append(lp.index_select(1, targets))
    join = (lambda parts, width: torch.cat(parts).reshape(*shape, width))
    return join(ids, k), join(lps, k), join(tgt, len(targets)) if targets is not None else None


class LensBuffers:
    """One request's lens rows by position (CPU), filled as its states are captured."""

    def __init__(self, points: tuple[str, ...], num_layers: dict[str, int], k: int, targets: list[int] | None,
                 fn: LensFn, device: torch.device) -> None:
        self.points = tuple(p for p in points if p in LENS_POINTS)
        self.num_layers = num_layers
        self.k = k
        self.target_list = targets
        self.targets = torch.tensor(targets, device=device) if targets else None
        self.fn = fn
        self.device = device
        self.rows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def _ensure(self, point: str, rows: int) -> None:
        layers, t = self.num_layers[point], len(self.target_list or ())
        have = self.rows.get(point)
        if have is not None and have[0].shape[0] >= rows:
            return
        size = max(rows, 2 * have[0].shape[0]) if have is not None else rows
        new = (torch.empty((size, layers, self.k), dtype=torch.long),
               torch.empty((size, layers, self.k), dtype=torch.float32),
               torch.empty((size, layers, t), dtype=torch.float32) if t else None)
        if have is not None:
            n = have[0].shape[0]
            for dst, src in zip(new, have):
                if dst is not None:
                    dst[:n].copy_(src)
        self.rows[point] = new

    def consume(self, point: str, states: torch.Tensor, first_row: int) -> None:
        """Lens of ``states`` ``[n, layers, hidden]`` into rows ``[first_row, first_row + n)``."""
        if point not in self.points:
            return
        ids, lps, tgt = lens_of(states, point, self.k, self.targets, self.fn)
        end = first_row + states.shape[0]
        self._ensure(point, end)
        bufs = self.rows[point]
        bufs[0][first_row:end].copy_(ids)
        bufs[1][first_row:end].copy_(lps)
        if tgt is not None:
            bufs[2][first_row:end].copy_(tgt)

    def result(self, n: int) -> Lens:
        """The first ``n`` rows of every lens point."""
        out = {}
        for point in self.points:
            ids, lps, tgt = self.rows.get(point) or (None, None, None)
            if ids is None:
                layers = self.num_layers[point]
                ids = torch.empty((0, layers, self.k), dtype=torch.long)
                lps = torch.empty((0, layers, self.k))
                tgt = torch.empty((0, layers, len(self.target_list))) if self.target_list else None
            out[point] = LensResult(ids[:n].clone(), lps[:n].clone(), tgt[:n].clone() if tgt is not None else None)
        return Lens(out, self.target_list)

    def of_reduced(self, tensors: dict[str, torch.Tensor]) -> Lens:
        """The lens of reduced states ``[layers, hidden]`` (on the model's device): reduce, then lens."""
        out = {}
        for point in self.points:
            ids, lps, tgt = lens_of(tensors[point].to(self.device), point, self.k, self.targets, self.fn)
            out[point] = LensResult(ids.cpu(), lps.cpu(), tgt.cpu() if tgt is not None else None)
        return Lens(out, self.target_list)
