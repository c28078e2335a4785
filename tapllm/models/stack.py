"""Blocks that nobody taps, run by one C++ call per step (``decoder_layers`` of tapllm.kernels).

In a step of decodes the per-operator Python dispatch of a block (~15 calls) costs more than
its arithmetic on a small model. For pre-norm Llama-style blocks (Llama, Mistral, Qwen2,
Phi-3: fused qkv with optional bias, full or partial rotary, a gated SiLU/GELU MLP, no
q/k norms or soft-caps) the model hands every run of consecutive blocks that the step's tap
leaves alone to the C++ runner; blocks some request captures or steers run in Python as
always, so taps see exactly the values they would see on the eager path.

Under tensor parallelism on one machine, a rank's o and down projections are row-parallel (they
carry their group): the runner all-reduces their partial sums itself through the group's shared
memory region, pausing every ``WAIT_SLICE_S`` so the group can ask whether a rank is gone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tapllm.kernels.constants import DECODER_SLOTS
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.linear import Linear
from tapllm.layers.norm import RMSNorm
from tapllm.quant.linear import QuantLinear, SplitQuantLinear


def _weight(linear: Linear | QuantLinear) -> torch.Tensor:
    if isinstance(linear, QuantLinear):
        return linear.blocks  # uint8 blocks: decoder.cpp hands them to quant_linear
    return linear.packed if linear.packed is not None else linear.weight


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _group(layers: nn.ModuleList) -> tuple[bool, Any]:
    """``(fits, group)``: the tensor-parallel group every o and down projection reduces over (None: plain
    linears); ``fits`` is False where some are row-parallel and others not, over other groups, or where
    the group does not meet in shared memory (the runner cannot all-reduce through gloo)."""
    plain = (Linear, QuantLinear, SplitQuantLinear)
    if all(type(m) in plain for layer in layers for m in _linears(layer)):
        return True, None
    groups = {getattr(m, "group", None) for layer in layers for m in _linears(layer)[1::2]}
    columns = all(type(m) in plain for layer in layers for m in _linears(layer)[::2])
    if len(groups) != 1 or not columns:
        return False, None
    group = groups.pop()
    return group is not None and getattr(group, "ops", None) is not None, group


class DecoderStack:
    """The C++ runner's view of a model's blocks; built by :meth:`maybe` when every block fits."""

    def __init__(self, ops: Any, layers: nn.ModuleList, scale: float, eps: float, act: int, packed: bool,
                 invariant: bool = False) -> None:
        self.ops = ops
        self.layers = layers
        self.scale, self.eps, self.act, self.packed = scale, eps, act, packed
        self.invariant = invariant  # batch_invariant: the packed GEMV at every size, row_attention
        first = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv, first.head_dim
        self.windows = [layer.self_attn.opts.window or 0 for layer in layers]
        norm = layers[0].post_attention_layernorm.weight  # the residual's width and dtype
        self.hidden, self.itemsize = norm.shape[-1], norm.element_size()
        self.act_bits = 0  # the quantized linears' activation rounding (QuantLinear.act_bits)
        # per block: whether the runner takes it (a block with a SplitQuantLinear runs in Python)
        self.runs = [all(type(m) is not SplitQuantLinear for m in _linears(layer)) for layer in layers]
        # the most rows its linears take the packed GEMV for (Linear.gemv_rows; the runner's own cut is
        # GEMV_MAX_ROWS): a step of more is given no GEMV views
        self.gemv_rows = min((m.gemv_rows for layer in layers for m in _linears(layer) if isinstance(m, Linear)),
                             default=0)
        self.group: Any = None  # the tensor-parallel group o and down reduce over (see _group)
        self._kv: list | None = None
        self._params: list[list[torch.Tensor | None]] = []
        self._plain: list[list[torch.Tensor | None]] = []  # the same without GEMV views

    @classmethod
    def maybe(cls, ops: Any, layers: nn.ModuleList, block: type | None, attention: type,
              mlp: type, invariant: bool = False) -> DecoderStack | None:
        """A stack over ``layers`` when every one is a ``block`` (the family's pre-norm Llama-style
        block) of exactly ``attention`` and gated ``mlp`` modules, else None. ``invariant``
        (batch_invariant): only where every linear has the packed GEMV, which the runner then takes
        at every size."""
        if ops is None or block is None or not hasattr(ops, "decoder_layers") or not len(layers):
            return None
        if any(type(layer) is not block for layer in layers):
            return None
        fits, group = _group(layers)
        linears = [m for layer in layers for m in _linears(layer) if type(m) is not SplitQuantLinear]
        if not fits or any(not isinstance(m, Linear | QuantLinear) for m in linears) or not linears:
            return None
        if invariant and any(getattr(m, "gemv", None) is None for m in linears):
            return None
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        eps = getattr(layers[0].input_layernorm, "eps", None)
        packed = {m.packed is not None for m in linears if isinstance(m, Linear)}  # quantized ones need no flag
        mlp_type = mlp
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (type(attn) is not attention or type(mlp) is not mlp_type
                    or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm
                    or attn.opts.softcap is not None or attn.opts.scale != attn0.opts.scale or not attn.rotary_dim
                    or mlp.kernel_act is None or mlp.kernel_act != mlp0.kernel_act
                    or layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps):
                return None
        act_bits = {m.act_bits for m in linears if isinstance(m, QuantLinear)}
        if len(packed) > 1 or len(act_bits) > 1:
            return None
        stack = cls(ops, layers, attn0.opts.scale, eps, mlp0.kernel_act, packed.pop() if packed else False, invariant)
        stack.act_bits = act_bits.pop() if act_bits else 0
        stack.group = group
        return stack

    def applies(self, meta: AttentionMetadata, rows: int) -> bool:
        """True for a step of decodes only (prefill chunks keep the Python blocks and SDPA), whose rows
        go through the group's shared memory in one round where the model is split."""
        if self.group is not None and not self.group.fits_round(rows * self.hidden * self.itemsize):
            return False
        return meta.attn is not None and meta.num_decodes == rows and not meta.prefills and not meta.prefill_groups

    def _layer_params(self, kv_caches: list) -> list[list[torch.Tensor | None]]:
        if self._kv is not kv_caches:
            params = []
            for layer, runs, (k, v) in zip(self.layers, self.runs, kv_caches):
                if not runs:
                    params.append([None] * len(DECODER_SLOTS))  # never handed to the runner
                    continue
                slots = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                         "k_cache": k, "v_cache": v}
                for name, m in zip(("qkv", "o", "gate_up", "down"), _linears(layer)):
                    slots.update({name: _weight(m), f"{name}_bias": m.bias, f"{name}_gemv": getattr(m, "gemv", None)})
                params.append([slots[name] for name in DECODER_SLOTS])
            plain = [[None if name.endswith("_gemv") else p for name, p in zip(DECODER_SLOTS, layer)]
                     for layer in params]
            self._kv, self._params, self._plain = kv_caches, params, plain
        return self._params

    def run(self, x: torch.Tensor, start: int, stop: int, ctx: Any, kv_caches: list,
            meta: AttentionMetadata) -> torch.Tensor:
        """Blocks ``[start, stop)`` on ``x`` [T, hidden] (updated in place); ``ctx`` is the rotary (cos, sin)."""
        t = x.shape[0]
        layers = self._layer_params(kv_caches)
        if not self.invariant and t > self.gemv_rows:
            layers = self._plain
        params = [p for layer in layers[start:stop] for p in layer]
        cos, sin = ctx
        x = x.contiguous()
        args = (x, params, cos.view(t, -1), sin.view(t, -1), meta.slot_mapping, meta.decode_block_tables,
                meta.decode_lens, self.heads, self.kv_heads, self.head_dim, self.eps, self.scale,
                self.windows[start:stop], self.act, self.packed, self.act_bits, self.invariant)
        group = self.group
        if group is None:
            return self.ops.decoder_layers(*args)
        layers_run = stop - start
        state = torch.tensor([0, 0, group.seq], dtype=torch.int64)

        def call(wait_s: float) -> int | None:
            self.ops.decoder_layers(*args, group.region, group.rank, group.size, wait_s, state)
            layer, phase, _ = state.tolist()
            return None if layer == layers_run else 3 * layer + phase

        group.native_rounds("all_reduce in the decoder runner", 2 * layers_run, x.numel() * x.element_size(), call)
        return x
