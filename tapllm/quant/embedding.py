"""An embedding table kept as packed blocks (see :mod:`tapllm.quant.pack`).

The table ``[vocab, hidden]`` is stored like a quantized linear's weight (``uint8 [vocab, G, B]``,
a tied LM head computes with the very same tensor), and a lookup dequantizes only the rows
of the looked-up tokens: with tapllm's ``quant_dequantize`` kernel when the fused kernels run,
else :func:`tapllm.quant.pack.dequantize` (float32, then rounded to the model dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from tapllm.backends.ops import QuantOps
from tapllm.quant.linear import QuantLinear, block_shape, fill_rows
from tapllm.quant.pack import dequantize
from tapllm.quant.schemes import Quantization


class QuantEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over packed rows ``blocks`` ``uint8 [num_embeddings, G, B]``.

    It has no ``weight``: :meth:`dequantized` is the float table (all of it; for tests and tools).
    """

    ops: QuantOps | None = None  # the backend's dequantizing kernel (set by CausalLM.use_backend)

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, quant: Quantization,
                 shape: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype, self.quant = num_embeddings, embedding_dim, dtype, quant
        shape = shape or block_shape(quant, embedding_dim)
        if shape is None:
            raise ValueError(f"{quant.describe()} cannot pack an embedding of width {embedding_dim}")
        self.register_buffer("blocks", torch.empty(num_embeddings, *shape, dtype=torch.uint8))  # as QuantLinear's

    def load_rows(self, offset: int | None, value: torch.Tensor) -> None:
        """Fill rows ``offset..`` (``None``: all) from float rows (quantized here) or packed rows (copied)."""
        fill_rows(self.blocks, self.embedding_dim, self.quant, offset, value)

    def dequantized(self) -> torch.Tensor:
        """The whole float32 table the lookups read (a full copy: not used on the inference path)."""
        return dequantize(self.blocks, self.embedding_dim)

    def head(self, bias: bool = False) -> QuantLinear:
        """A :class:`QuantLinear` LM head over this table's blocks (shared storage, no second copy)."""
        layer = QuantLinear(self.embedding_dim, self.num_embeddings, bias, self.dtype, self.quant,
                            shape=(1, 1))  # placeholder blocks, replaced by the shared ones below
        layer.blocks = self.blocks
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        if self.ops is not None:
            out = self.ops.quant_dequantize(rows, self.embedding_dim, self.dtype)
        else:
            out = dequantize(rows, self.embedding_dim).to(self.dtype)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        _, groups, nbytes = self.blocks.shape
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.quant.describe()}, "
                f"blocks={groups}x{nbytes}B")


def quantize_embedding(model: nn.Module, quant: Quantization, shape: tuple[int, int] | None = None) -> bool:
    """Replace ``model.embed_tokens`` (an ``nn.Embedding``, before loading) by a :class:`QuantEmbedding`
    with empty storage, of ``shape`` (a GGUF file's blocks) or ``quant``'s layout; False when it cannot."""
    emb = getattr(model, "embed_tokens", None)
    if not isinstance(emb, nn.Embedding):
        return False
    n, k = emb.weight.shape
    if (shape or block_shape(quant, k)) is None:
        return False
    model.embed_tokens = QuantEmbedding(n, k, emb.weight.dtype, quant, shape=shape)
    return True
