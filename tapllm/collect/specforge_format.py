"""EAGLE-3 training data in SGLang SpecForge's offline layout (``--out/specforge/``).

The folder is what SpecForge's offline trainer reads (``--train-hidden-states-path``; its
``OfflineManifestReader`` lists every ``*.ckpt`` below it): one ``torch.save`` file a
conversation, ``rows_{a}-{a + 2000}/data_{i}.ckpt`` as ``prepare_hidden_states.py`` groups
them, holding

- ``input_ids`` ``[seq]`` and ``loss_mask`` ``[seq]`` (int64),
- ``aux_hidden_state`` ``[1, seq, 3 * hidden]``: the three auxiliary layers side by side,
- ``hidden_state`` ``[1, seq, hidden]``: the last block's output after the final norm (what
  SGLang's logits processor receives; SpecForge applies only the LM head to it);

and ``vocab_mapping.pt`` (``{"d2t", "t2d"}``), the draft-vocabulary mapping its trainer takes
as ``--vocab-mapping-path``. Files are serialized into memory first, so the archive's inner
name does not depend on the temporary file's, and a rerun writes the same bytes.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import torch

from tapllm.collect.shards import write_file

FOLDER = "specforge"
GROUP = 2000  # files a subfolder, as SpecForge's prepare_hidden_states.py groups them


def ckpt_path(out: Path, index: int) -> Path:
    """Where conversation ``index``'s file goes."""
    a = index // GROUP * GROUP
    return out / FOLDER / f"rows_{a}-{a + GROUP}" / f"data_{index}.ckpt"


def write_sample(out: Path, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
                 final: torch.Tensor, write: Callable[[Path, bytes], None] = write_file) -> None:
    """One conversation's file: ``aux`` ``[seq, 3, hidden]``, ``final`` ``[seq, hidden]``, put in
    place by ``write(path, data)``."""
    seq = aux.shape[0]
    record = {"input_ids": input_ids.to(torch.long).contiguous(), "loss_mask": loss_mask.to(torch.long).contiguous(),
              "hidden_state": final.reshape(1, seq, -1).contiguous(),
              "aux_hidden_state": aux.reshape(1, seq, -1).contiguous()}
    buf = io.BytesIO()
    torch.save(record, buf)
    path = ckpt_path(out, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, buf.getvalue())


def write_vocab(out: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """``vocab_mapping.pt``."""
    folder = out / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"d2t": d2t, "t2d": t2d}, buf)
    write_file(folder / "vocab_mapping.pt", buf.getvalue())
