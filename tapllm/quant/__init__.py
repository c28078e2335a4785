"""Weights kept quantized: int8 / int4 weight-only schemes, their packing, :class:`QuantLinear`
and :class:`QuantEmbedding` (``tapllm.quant.linear``, ``tapllm.quant.embedding``)."""

from tapllm.quant.schemes import QUANTIZATIONS, Quantization, parse_quantization

__all__ = ["QUANTIZATIONS", "Quantization", "parse_quantization"]
