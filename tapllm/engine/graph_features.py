"""The SAE features of a graph decode step's requests that keep only those: each SAE's rows gathered from
the capture buffer in one op, encoded and copied to the host at once, each request taking its row."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tapllm.hidden_states.capture import RequestCapture
from tapllm.hidden_states.sink import CopySink
from tapllm.sae.batch import PackLayouts, group_pack
from tapllm.sae.features import FeatureSelection

# A request of one SAE that keeps only its features: its capture, selection, position, and the numbers
# where its SAE input and target (0: none) start in the capture buffer.
FeatureRow = tuple[RequestCapture, FeatureSelection, int, int, int]
RowsAt = Callable[[Sequence[int], str, int], torch.Tensor]  # (first numbers, point, layer key) -> rows


def rows_at(buffer: torch.Tensor, width: int, starts: Sequence[int]) -> torch.Tensor:
    """The rows of ``width`` numbers of the flat ``buffer`` that start at ``starts``: ``[len(starts), width]``,
    one gather."""
    # through numpy: a third of torch.tensor's time on a list of ints
    index = torch.from_numpy(np.array(starts, dtype=np.int64)).to(buffer.device, non_blocking=True)
    # Every run of ``width`` numbers of the buffer as a row (a view): a row's first number picks it.
    return buffer.unfold(0, width, 1).index_select(0, index)


def deliver_features(groups: dict[int, list[FeatureRow]], sink: CopySink, failed: dict[RequestCapture, str],
                     rows: RowsAt, layouts: PackLayouts) -> None:
    """Encode each SAE's ``groups`` (rows by ``rows``) and hand each request its row; a group that fails
    puts its requests in ``failed``."""
    for g in groups.values():
        caps, sels, positions, inputs, targets = zip(*g)
        try:
            fs = sels[0]
            x = rows(inputs, fs.point, fs.key)
            target = None if fs.out is None else rows(targets, *fs.out)
            layout = layouts.get(list(sels))
            host = sink.host_copy(group_pack(fs.sae, layout.sels, x, target, layout, True))
        except Exception as exc:  # noqa: BLE001 - the group's requests fail, the others go on
            for cap in caps:
                failed[cap] = f"hidden_states: computing SAE features failed: {type(exc).__name__}: {exc}"
            continue
        for row, (cap, cols, a) in enumerate(zip(caps, layout.columns, positions)):
            cap.take_features_one(host, row, cols, a)
