"""The numbers tapllm's C++ kernels and its Python code must agree on, in one table.

:mod:`tapllm.kernels.build` writes this table into a header, ``constants.h``, compiled with the
kernels (its text is part of the build's cache key, so an edit here rebuilds them): every
upper-case integer becomes a ``constexpr int64_t`` of the same name, and a tuple of names
``NAMES`` becomes ``namespace names { constexpr int64_t name = <its index>; }`` plus
``NAMES_COUNT``. Python code imports the same values from here.
"""

from __future__ import annotations

# The most rows of a step that a packed GEMV takes (tapllm/kernels/gemv.py, csrc/packed_gemv.cpp,
# csrc/decoder.cpp); larger steps keep oneDNN's call. On the default model's linear shapes the kernel
# is faster than oneDNN's call up to 64 rows and no longer beyond: the cut is 64.
GEMV_MAX_ROWS = 64

# RMSNorm orders (the ``mode`` of the rms_norm ops): Llama's (round, then scale in the dtype), scale in
# float32 and round once (OLMo-2), Gemma's ``1 + w`` in float32.
RMS_LLAMA, RMS_FLOAT_SCALE, RMS_GEMMA = 0, 1, 2

# Gated activations (the ``mode`` of gated_act): SiLU, GELU's tanh approximation.
ACT_SILU, ACT_GELU_TANH = 0, 1

# The parameters of one layer of the C++ decoder runner (decoder_layers), in the order it reads them:
# the norms' weights, each linear's weight (oneDNN-packed, quantized blocks or plain) and bias (or None),
# the layer's KV cache, then each linear's packed_view for the GEMV (or None).
DECODER_SLOTS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias",
                 "down", "down_bias", "k_cache", "v_cache", "qkv_gemv", "o_gemv", "gate_up_gemv", "down_gemv")
