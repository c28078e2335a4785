"""Read a dataset written by ``tapllm collect``: ``tapllm.datasets.open(DIR)`` returns an
:class:`ActivationDataset` (see :mod:`tapllm.collect.dataset`, where both live, so the collect
package's readers use them without importing upward)."""

from tapllm.collect.dataset import ActivationDataset, ShuffledRows, open  # noqa: A004 - the reader's natural name

__all__ = ["ActivationDataset", "ShuffledRows", "open"]
