"""What ``quantization=`` may say, validated where it enters (``LLM``, the CLI, the server).

Spellings follow vLLM where it has one: ``"int8"`` (weight-only, one scale per output
channel), ``"int4"`` (weight-only, asymmetric, a scale and a min per group of input
channels), ``"q4_k"`` (llama.cpp's name: int4 in GGUF's Q4_K super-blocks, quantized at load;
its integer scales let ``quantize_activations`` fold them into the integer products), ``"gguf"`` (a GGUF file's quantized tensors kept as stored). ``None`` keeps the
model's dtype for every weight.

``quantize_activations`` adds llama.cpp's scheme for its Q4/Q8 files: the inputs of every
quantized linear are rounded to int8 per run of 32 values before the product (integer dot
products, ~1.4-2x faster at decode batch sizes), at the cost of that rounding in every
state (reported: results name it ``"+a8"``).
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("int8", "int4", "q4_k", "gguf")  # gguf: a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors as stored
INT4_GROUPS = (32, 64, 128)
DEFAULT_INT4_GROUP = 128  # torchao's and GPTQ's usual choice: 4.5 bits per weight with float32 scale/min


@dataclass(frozen=True, slots=True)
class Quantization:
    """A validated quantization choice: ``method`` and, for int4, the ``group`` size."""

    method: str
    group: int | None = None
    int8_activations: bool = False

    @property
    def act_bits(self) -> int:
        """What the quantized linears round their inputs to: 8 (int8 per 32 values) or 0 (kept float)."""
        return 8 if self.int8_activations else 0

    def describe(self) -> str:
        """The short name results and the server report, e.g. ``"int4-g128"`` or ``"gguf+a8"``."""
        name = f"{self.method}-g{self.group}" if self.method == "int4" else self.method
        return name + ("+a8" if self.int8_activations else "")


def parse_quantization(method: str | None, group: int | None = None,
                       int8_activations: bool = False) -> Quantization | None:
    """Check ``quantization``, ``quantization_group_size`` and ``quantize_activations``;
    ``ValueError`` names the field."""
    if not isinstance(int8_activations, bool):
        raise ValueError(f"quantize_activations must be True or False, got {int8_activations!r}")
    if method is None or method == "none":
        if group is not None:
            raise ValueError("quantization_group_size applies to quantization='int4' only")
        if int8_activations:
            raise ValueError("quantize_activations needs a quantization ('int8', 'int4', 'q4_k' or 'gguf')")
        return None
    if not isinstance(method, str) or method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {method!r}")
    if method != "int4":
        if group is not None:
            raise ValueError(f"quantization_group_size applies to quantization='int4' only, not {method!r}")
        return Quantization(method, None, int8_activations)
    group = DEFAULT_INT4_GROUP if group is None else group
    if isinstance(group, bool) or not isinstance(group, int) or group not in INT4_GROUPS:
        raise ValueError(f"quantization_group_size must be one of {list(INT4_GROUPS)}, got {group!r}")
    return Quantization("int4", group, int8_activations)
