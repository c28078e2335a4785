"""The SAE latents of a dataset collected with ``tapllm collect --sae``, as evaluation data.

Each token row holds its ``K`` largest latents sparse (``sae_ids`` int32 and ``sae_values``
float32, ``[1, K]``, largest first, 0 past the latents that fired) and ``sae_error_norm``
(``||x - reconstruction||``); ``metadata.json`` names the SAE (``sae``: source, architecture,
point, layer, ``d_sae``, ``top``, digest of its weights). :class:`SAELatents` reads them back:

>>> lat = SAELatents("acts/")
>>> b = lat.batch(range(1000))         # LatentBatch: ids [n, K], values [n, K], error_norm [n], ...
>>> b.dense()                          # [n, d_sae] float32: the dense latents (0 off the top K)
>>> b.sparse()                         # [n, d_sae] sparse COO tensor of the latents that fired
>>> for b in lat.iter_batches(8192): ...
>>> s = lat.stats()                    # per-latent firing counts, density, mean/max value; L0; error; FVU
>>> lat.top_examples(feature=123, n=20)  # the rows where latent 123 is largest

A latent that fired but was not among a row's ``K`` largest is not stored: where a row has
``K`` nonzero values (``saturated``), its L0 and the densities are lower bounds; with fewer,
they are exact. ``stats`` reports the saturated fraction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tapllm.collect.readers import gather, in_order

COLUMNS = ["sae_ids", "sae_values", "sae_error_norm", "request_index", "position", "token_id"]


@dataclass(slots=True)
class LatentBatch:
    """Rows of SAE latents: ``ids`` ``[n, K]`` (int64), ``values`` ``[n, K]`` (float32, 0 where
    nothing more fired), ``error_norm`` ``[n]``, and each row's ``request_index``, ``position``
    and ``token_id``."""

    ids: torch.Tensor
    values: torch.Tensor
    error_norm: torch.Tensor
    request_index: torch.Tensor
    position: torch.Tensor
    token_id: torch.Tensor
    d_sae: int

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def l0(self) -> torch.Tensor:
        """Latents stored as fired, per row (``[n]``)."""
        return (self.values != 0).sum(1)

    def dense(self) -> torch.Tensor:
        """The latents as a dense ``[n, d_sae]`` float32 tensor (0 off each row's top ``K``)."""
        return torch.zeros(len(self), self.d_sae).scatter_(1, self.ids, self.values)

    def sparse(self) -> torch.Tensor:
        """The latents that fired as a coalesced ``[n, d_sae]`` sparse COO tensor (``.to_sparse_csr()``
        gives rows)."""
        ids, order = self.ids.sort(dim=1)
        values = self.values.gather(1, order)
        fired = values != 0
        rows = torch.arange(len(self)).unsqueeze(1).expand_as(ids)
        return torch.sparse_coo_tensor(torch.stack([rows[fired], ids[fired]]), values[fired], (len(self), self.d_sae),
                                       is_coalesced=True, check_invariants=True)


@dataclass(slots=True)
class LatentStats:
    """What a pass over the latents gives (see :meth:`SAELatents.stats`).

    Per latent (``[d_sae]``): ``fires`` (rows where it is stored as fired), ``density``
    (``fires / rows``), ``mean_value`` (over the rows where it fired; 0 for a latent that never
    did) and ``max_value``. Over rows: ``mean_l0``, ``saturated`` (fraction of rows with ``K``
    nonzero values), ``mse`` (mean of ``error_norm ** 2``, the summed squared error per row) and
    ``fvu`` (``sum error_norm ** 2 / sum ||x - mean x|| ** 2``, when the dataset holds the SAE's
    input point at its layer; else ``None``). ``dead``: latents that never fired.
    """

    rows: int
    fires: torch.Tensor
    density: torch.Tensor
    mean_value: torch.Tensor
    max_value: torch.Tensor
    mean_l0: float
    saturated: float
    mse: float
    fvu: float | None

    @property
    def dead(self) -> int:
        """Latents that never fired."""
        return int((self.fires == 0).sum())


class SAELatents:
    """The SAE latents of a collected dataset (see the module docstring).

    ``dataset``: a folder written by ``tapllm collect --sae`` or an opened
    :class:`tapllm.datasets.ActivationDataset`; ``ValueError`` when it holds no SAE latents.
    """

    def __init__(self, dataset: Any) -> None:
        if isinstance(dataset, str | Path):
            from tapllm.collect import dataset as activation_dataset

            dataset = activation_dataset.open(dataset)
        sae = dataset.metadata.get("sae")
        if sae is None or "sae_ids" not in dataset.view(0).columns:
            raise ValueError(f"{dataset.path} holds no SAE latents (collect it with --sae PATH)")
        self.ds = dataset
        self.sae: dict[str, Any] = dict(sae)
        self.d_sae = int(sae["d_sae"])
        self.top = int(sae["top"])

    def __len__(self) -> int:
        return len(self.ds)

    def _batch(self, cols: dict[str, torch.Tensor]) -> LatentBatch:
        return LatentBatch(ids=cols["sae_ids"][:, 0].long(), values=cols["sae_values"][:, 0].float(),
                           error_norm=cols["sae_error_norm"].float(), request_index=cols["request_index"],
                           position=cols["position"], token_id=cols["token_id"], d_sae=self.d_sae)

    def batch(self, rows: Iterable[int] | torch.Tensor | np.ndarray) -> LatentBatch:
        """Rows ``rows`` (global row numbers, any order) of the latents."""
        idx = np.asarray(rows.cpu() if isinstance(rows, torch.Tensor) else list(rows), dtype=np.int64).reshape(-1)
        n = len(self.ds)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"rows must be in [0, {n}), got {int(idx.min())}..{int(idx.max())}")
        return self._batch(gather(self.ds, idx, COLUMNS))

    def iter_batches(self, batch_size: int = 8192) -> Iterator[LatentBatch]:
        """The latents in input order, reading only the latent and index columns."""
        for cols in in_order(self.ds, batch_size, COLUMNS):
            yield self._batch(cols)

    def _input_point(self) -> tuple[str, int] | None:
        point, layer = self.sae.get("point"), self.sae.get("layer")
        if point in self.ds.points and layer in self.ds.layers:
            return point, int(layer)
        return None

    def stats(self, batch_size: int = 8192) -> LatentStats:
        """One pass over the dataset: per-latent firing statistics, L0, reconstruction error (and
        the fraction of variance unexplained when the SAE's input is stored too)."""
        fires = torch.zeros(self.d_sae, dtype=torch.float64)
        sums = torch.zeros(self.d_sae, dtype=torch.float64)
        maxes = torch.zeros(self.d_sae, dtype=torch.float32)
        rows = l0 = saturated = 0
        sq_err = 0.0
        for b in self.iter_batches(batch_size):
            fired = b.values != 0
            ids, vals = b.ids[fired], b.values[fired]
            fires += torch.bincount(ids, minlength=self.d_sae).double()
            sums.index_add_(0, ids, vals.double())
            maxes.scatter_reduce_(0, ids, vals, reduce="amax")
            per_row = fired.sum(1)
            rows += len(b)
            l0 += int(per_row.sum())
            saturated += int((per_row == self.top).sum())
            sq_err += float(b.error_norm.double().pow(2).sum())
        if rows == 0:
            raise ValueError("the dataset has no rows")
        fvu = None
        where = self._input_point()
        if where is not None:
            fvu = sq_err / self._total_variance(*where, batch_size)
        mean = torch.where(fires > 0, sums / fires.clamp(min=1), torch.zeros_like(sums))
        return LatentStats(rows=rows, fires=fires.long(), density=(fires / rows).float(), mean_value=mean.float(),
                           max_value=maxes, mean_l0=l0 / rows, saturated=saturated / rows, mse=sq_err / rows,
                           fvu=fvu)

    def _total_variance(self, point: str, layer: int, batch_size: int) -> float:
        """``sum ||x - mean x|| ** 2`` of the SAE's input over all rows (float64 sums)."""
        total = None
        sq = 0.0
        n = 0
        for cols in in_order(self.ds, batch_size, [point], [layer]):
            x = cols[point][:, 0].double()
            total = x.sum(0) if total is None else total + x.sum(0)
            sq += float(x.pow(2).sum())
            n += x.shape[0]
        assert total is not None
        return sq - float(total.pow(2).sum()) / n

    def top_examples(self, feature: int, n: int = 20, batch_size: int = 8192) -> LatentBatch:
        """The ``n`` rows where latent ``feature`` is largest, largest first (as a batch)."""
        if not 0 <= feature < self.d_sae:
            raise ValueError(f"feature must be in [0, {self.d_sae}), got {feature}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        best_v = torch.empty(0)
        best_r = torch.empty(0, dtype=torch.int64)
        start = 0
        for b in self.iter_batches(batch_size):
            hit = (b.ids == feature) & (b.values != 0)
            r, k = hit.nonzero(as_tuple=True)
            best_v = torch.cat([best_v, b.values[r, k]])
            best_r = torch.cat([best_r, r + start])
            if len(best_v) > n:
                keep = best_v.topk(n).indices
                best_v, best_r = best_v[keep], best_r[keep]
            start += len(b)
        order = best_v.argsort(descending=True, stable=True)
        return self.batch(best_r[order])
