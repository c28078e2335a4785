"""EAGLE-3 training data in vLLM speculators' offline layout (``--out/speculators/``).

The folder is what speculators' trainer takes as its data path (``ArrowDataset(datapath=...)``):

- a Hugging Face ``datasets`` folder (``state.json``, ``dataset_info.json``,
  ``data-00000-of-00001.arrow``; torch format) with one row per conversation: ``input_ids``
  and ``loss_mask`` (int64 lists) and ``seq_len``;
- ``hidden_states/hs_{i}.safetensors`` for row ``i``: ``hidden_states`` ``[seq_len, 4, hidden]``
  (the three auxiliary layers, then the last block's output before the final norm, which
  speculators' ``verifier_norm`` applies) and ``token_ids`` ``[seq_len]`` (int64), as vLLM's
  ``extract_hidden_states`` connector writes them;
- ``token_freq.pt`` (``{token id: count}`` over the loss-masked tokens) and
  ``d2t-{V}.npy`` / ``t2d-{V}.npy``, the draft-vocabulary mapping its trainer looks for there.

The ``datasets`` files are written here rather than through ``Dataset.save_to_disk``, which
stamps a random fingerprint: a rerun must give the same bytes.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from tapllm.collect.shards import write_file

FOLDER = "speculators"
ARROW = "data-00000-of-00001.arrow"


def hs_path(out: Path, index: int) -> Path:
    """Where conversation ``index``'s states go."""
    return out / FOLDER / "hidden_states" / f"hs_{index}.safetensors"


def write_states(out: Path, index: int, token_ids: torch.Tensor, states: torch.Tensor,
                 write: Callable[[Path, bytes], None] = write_file) -> None:
    """One conversation's file: ``states`` ``[seq, layers, hidden]`` (aux layers, then the last),
    put in place by ``write(path, data)``."""
    from safetensors.torch import save

    data = save({"hidden_states": states.contiguous(), "token_ids": token_ids.to(torch.long).contiguous()})
    path = hs_path(out, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, data)


def write_rows(out: Path, input_ids: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> None:
    """The ``datasets`` folder of the conversations, in order (row ``i`` is ``hs_{i}``)."""
    import pyarrow as pa
    from datasets import DatasetInfo, Features

    folder = out / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "input_ids": pa.array([t.tolist() for t in input_ids], type=pa.list_(pa.int64())),
        "loss_mask": pa.array([t.tolist() for t in loss_masks], type=pa.list_(pa.int64())),
        "seq_len": pa.array([len(t) for t in input_ids], type=pa.int64()),
    })
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    write_file(folder / ARROW, data)
    info = asdict(DatasetInfo(features=Features.from_arrow_schema(table.schema)))
    write_file(folder / "dataset_info.json", json.dumps({k: info[k] for k in sorted(info)}, indent=2))
    import hashlib

    state = {"_data_files": [{"filename": ARROW}], "_fingerprint": hashlib.sha256(data).hexdigest()[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False,
             "_split": None}
    write_file(folder / "state.json", json.dumps(state, indent=2))


def write_vocab(out: Path, freq: dict[int, int], d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """``token_freq.pt`` and the ``d2t`` / ``t2d`` arrays for a draft vocabulary of ``len(d2t)``."""
    folder = out / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(freq, buf)
    write_file(folder / "token_freq.pt", buf.getvalue())
    for name, t in ((f"d2t-{len(d2t)}.npy", d2t), (f"t2d-{len(d2t)}.npy", t2d)):
        arr = io.BytesIO()
        np.save(arr, t.numpy())
        write_file(folder / name, arr.getvalue())
