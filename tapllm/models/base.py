"""What every model family shares: the forward loop with its taps, logits, weight loading.

A family is one file: its block (``forward(x, i, tap, ctx, kv, meta)``, straight-line code
with one ``tap`` per point), its embedding and final norm, and the map from its checkpoint's
tensor names to its (possibly fused) parameters. :class:`CausalLM` runs the blocks, taps
``embed`` and ``final`` around them, computes logits, loads and prepacks weights. A family
whose blocks hand on a :class:`~tapllm.models.residual.Residual` instead (``fused_blocks``:
``forward(res, i, tap, ctx, kv, meta) -> Residual``, the Llama block) leaves each block's end
add, and the ``embed`` tap, to the norm that reads them.
:class:`Attention` is the shared self-attention: fused q/k/v projection, optional q/k norms,
full or partial rotary (or none), paged attention with the layer's window and soft-cap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.backends import Backend, ElementwiseOps
from tapllm.config import ModelConfig
from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU
from tapllm.layers.attention import AttentionMetadata, AttentionOptions, paged_attention
from tapllm.layers.linear import Linear, pack_linears, rowwise
from tapllm.layers.norm import RMSNorm
from tapllm.models.stack import DecoderStack
from tapllm.quant.embedding import QuantEmbedding
from tapllm.quant.linear import QuantLinear, SplitQuantLinear, block_shape
from tapllm.quant.schemes import Quantization
from tapllm.layers.rotary import apply_rotary
from tapllm.models.residual import Residual, add_norm
from tapllm.tap import PSEUDO_LAYER, Tap, no_tap
from tapllm.tap.fused import HeadSites, kernel_sites

logger = logging.getLogger("tapllm")

KVCache = tuple[torch.Tensor, torch.Tensor]
# A checkpoint tensor's destinations: (parameter name, first row or None for all of it, the tensor).
Placement = list[tuple[str, int | None, torch.Tensor]]


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache.

    ``qkv_proj`` holds q, k and v projections stacked in that order (``[H*D + 2*Hkv*D, hidden]``).
    ``rotary_dim`` rotates the first dims of each head (``None``: all of them, ``0``: no
    rotary, e.g. GPT-2's learned positions). Subclasses may normalise q and k: ``norm_qk``
    sees the flat projections (OLMo-2), ``norm_heads`` the per-head ones (Qwen3, Gemma-3).
    """

    ops: ElementwiseOps | None = None  # the backend's fused rotary (see CausalLM.use_backend)
    fused_kv_write: bool = False  # ``ops`` has rotary_kv_write (RotaryKVWriteOps): rotary and KV write in one kernel
    fused_sites: bool = False  # ``ops`` applies a graph step's q/k/v sites in that kernel (FusedSiteOps)
    clip_qkv: float | None = None  # q, k (after their norms) and v clamped to [-clip, clip] (OLMoE)

    def __init__(self, cfg: ModelConfig, layer: int, *, qkv_bias: bool, o_bias: bool, scale: float | None = None,
                 softcap: float | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, cfg.dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, o_bias, cfg.dtype)
        self.rotary_dim = self.head_dim if rotary_dim is None else rotary_dim
        window = cfg.sliding_windows[layer] if cfg.sliding_windows else None
        self.opts = AttentionOptions(scale=self.head_dim**-0.5 if scale is None else scale, window=window,
                                     softcap=softcap)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise the flat q ``[T, H*D]`` and k ``[T, Hkv*D]`` projections; identity by default."""
        return q, k

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise q ``[T, H, D]`` and k ``[T, Hkv, D]`` per head, before rotary; identity by default."""
        return q, k

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, kv: KVCache,
                meta: AttentionMetadata, tap: Tap = no_tap, i: int = 0) -> torch.Tensor:
        """Attention of block ``i``; ``q``/``k`` (after norms and rotary), ``v`` and ``z`` (the
        per-head output before ``o_proj``) pass through ``tap``."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv, self.head_dim)
        v = v.reshape(t, self.num_kv, self.head_dim)
        q, k = self.norm_heads(q, k)
        stored = False  # k and v already in the cache
        tapped = False  # q, k and v through their sites already
        if self.rotary_dim and self.ops is not None and cos_sin[0].shape[-1] == self.rotary_dim:
            cos, sin = cos_sin[0].view(t, self.rotary_dim), cos_sin[1].view(t, self.rotary_dim)
            sites = kernel_sites(tap) if self.fused_sites else None
            if sites is not None:  # the sites inside the kernel, before K/V reach the cache
                stored, tapped = meta.attn is not None, True
                self.ops.rotary_sites(q, k, v, cos, sin, (kv[0], kv[1], meta.slot_mapping) if stored else None,
                                      HeadSites(sites, sites.index("q", i), sites.index("k", i), sites.index("v", i)))
            else:
                # One kernel rotates and stores K/V where the attention kernels read the cache in place;
                # not where a tap steers k or v, whose steered values must be what the cache holds.
                stored = self.fused_kv_write and meta.attn is not None and not (tap.steers("k", i)
                                                                                or tap.steers("v", i))
                if stored:
                    self.ops.rotary_kv_write(q, k, v, cos, sin, kv[0], kv[1], meta.slot_mapping)
                else:
                    self.ops.rotary_(q, k, cos, sin)
        elif self.rotary_dim == self.head_dim:
            q, k = apply_rotary(q, k, cos_sin)
        elif self.rotary_dim:
            r = self.rotary_dim
            q_rot, k_rot = apply_rotary(q[..., :r], k[..., :r], cos_sin)
            q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        if not tapped:
            q, k, v = tap("q", i, q), tap("k", i, k), tap("v", i, v)
        z = tap("z", i, paged_attention(q, k, v, kv[0], kv[1], meta, self.opts, write_kv=not stored))
        if tap.wants_pattern(i):
            tap.pattern(i, q, kv[0], self.opts)
        return self.o_proj(z.reshape(t, self.q_size))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with fused gate/up projection (SwiGLU, GeGLU)."""

    ops: ElementwiseOps | None = None  # the backend's fused gated activation (see CausalLM.use_backend)
    fused_sites: bool = False  # ``ops`` applies a graph step's mlp_post site in that kernel (FusedSiteOps)

    def __init__(self, cfg: ModelConfig, act: Callable[[torch.Tensor], torch.Tensor], bias: bool = False,
                 intermediate: int | None = None) -> None:
        super().__init__()
        inter = int(intermediate if intermediate is not None else cfg.hf_config.intermediate_size)
        self.inter = inter
        self.act = act
        self.kernel_act = _KERNEL_ACTS.get(act)  # the fused kernel's mode for this activation, if it has one
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias, cfg.dtype)
        self.down_proj = Linear(inter, cfg.hidden_size, bias, cfg.dtype)

    def forward(self, x: torch.Tensor, tap: Tap = no_tap, i: int = 0) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and self.kernel_act is not None and gate_up.dim() == 2:
            sites = kernel_sites(tap) if self.fused_sites else None
            site = sites.index("mlp_post", i) if sites is not None else None
            if site is not None:  # the site inside the kernel
                h = self.ops.gated_act_sites(gate_up, self.kernel_act, sites, site)
                if h is not None:
                    return self.down_proj(h)
            return self.down_proj(tap("mlp_post", i, self.ops.gated_act(gate_up, self.kernel_act)))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(tap("mlp_post", i, self.act(gate) * up))


class MLP(nn.Module):
    """``down(act(up(x)))``, ungated (GPT-2, GPT-NeoX)."""

    def __init__(self, cfg: ModelConfig, act: Callable[[torch.Tensor], torch.Tensor], bias: bool,
                 intermediate: int) -> None:
        super().__init__()
        self.act = act
        self.inter = intermediate
        self.up_proj = Linear(cfg.hidden_size, intermediate, bias, cfg.dtype)
        self.down_proj = Linear(intermediate, cfg.hidden_size, bias, cfg.dtype)

    def forward(self, x: torch.Tensor, tap: Tap = no_tap, i: int = 0) -> torch.Tensor:
        return self.down_proj(tap("mlp_post", i, self.act(self.up_proj(x))))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' activation names (``hidden_act``, GPT-2's ``activation_function``) -> the function.
# gelu_new, gelu_fast and gelu_pytorch_tanh are all the tanh approximation of GELU.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "gelu_new": _gelu_tanh, "gelu_fast": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu, "relu": F.relu, "silu": F.silu, "swish": F.silu,
}


# The op of each module type that applies a graph step's sites in its kernel (FusedSiteOps).
_SITE_OPS = ((RMSNorm, "rms_norm_sites"), (Attention, "rotary_sites"), (GatedMLP, "gated_act_sites"))

# Activations the fused gated-MLP kernel computes.
_KERNEL_ACTS: dict[Callable[[torch.Tensor], torch.Tensor], int] = {F.silu: ACT_SILU, _gelu_tanh: ACT_GELU_TANH}


def kernel_activation(act: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
    """The fused gated-activation kernel's mode for ``act`` (``gated_act``), or None where it has none."""
    return _KERNEL_ACTS.get(act)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation transformers calls ``name``; ``ValueError`` for one not supported."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}") from None


class CausalLM(nn.Module):
    """A decoder-only LM over a paged KV cache; subclasses build the modules (see the module docstring).

    Set in a subclass's ``__init__``: ``embed_tokens`` (``nn.Embedding``; a quantized model's is
    a :class:`QuantEmbedding`, which has packed ``blocks`` and no ``weight``), ``layers``
    (blocks), ``norm`` (the final norm), ``lm_head`` (a :class:`Linear`, or ``None`` when
    tied to the embedding); optionally ``final_logit_softcap``. Override :meth:`embed`,
    :meth:`block_context` and :meth:`checkpoint_names` where the family differs.
    """

    final_logit_softcap: float | None = None
    backend: Backend | None = None  # how the forward runs (see use_backend); None: plain PyTorch
    stack: DecoderStack | None = None  # runs untapped blocks of decode steps in C++ (see use_backend)
    stack_block: type | None = None  # the family's block type that the C++ runner implements, if any
    needs_prompt_lengths = False  # True: the runner fills AttentionMetadata.prompt_lens each step
    graphs_off: str | None = None  # why the family's steps cannot be CUDA graphs (a host sync inside), or None
    eager_only: str | None = None  # why the family runs the eager step only (what the kernels lack), or None
    # True: blocks take and hand on a Residual (models/residual.py), so a block's end add is done in the
    # next norm's kernel, and the norms, rotary and activation apply a graph step's sites (tapllm.tap.fused).
    fused_blocks = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tied = bool(getattr(cfg.hf_config, "tie_word_embeddings", False))
        # The path each run of blocks of the latest forward took: (first block, stop, path) with
        # path "stack" (one C++ call), "fused" (Python blocks on the backend's ops) or "eager".
        self.last_runs: tuple[tuple[int, int, str], ...] = ()

    # ---- the forward -------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream entering block 0 (what ``embed`` captures)."""
        return self.embed_tokens(input_ids)

    def prompt_salt(self, num_prompt: int) -> bytes:
        """What besides the tokens a request's KV depends on because of its prompt length (b"" by default)."""
        return b""

    def block_context(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata) -> Any:
        """What every block needs about the step's rows (e.g. rotary cos/sin); None by default.

        ``meta`` tells which rows belong to one sequence, for families whose rotary depends
        on a sequence's extent in the step (Phi-3's LongRoPE).
        """
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        tap: Tap | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor | None:
        """Run the ragged batch; returns the final-norm hidden states [T, hidden].

        ``tap`` (the step's, or none when no request captures or steers) sees every point.
        ``num_layers`` stops after that many blocks (a step of prompt-only requests that capture
        nothing deeper); the blocks after it are not run, their KV not written, and ``None`` is
        returned.
        """
        tap = no_tap if tap is None else tap
        x = self.embed(input_ids, positions)
        # A chain of blocks leaves the embed tap to block 0's input norm; other blocks take whole residuals.
        res = Residual(x, on_sum=(("embed", PSEUDO_LAYER),)) if self.fused_blocks else \
            Residual(tap("embed", PSEUDO_LAYER, x))
        ctx = self.block_context(positions, x.dtype, meta)
        layers = self.layers[:num_layers]
        runs = self.plan_runs(len(layers), tap, meta, x.shape[0])
        for start, stop, path in runs:
            if path == "stack":  # the C++ runner takes and gives whole residuals
                res = Residual(self.stack.run(res.whole(tap), start, stop, ctx, kv_caches, meta))
                continue
            for i in range(start, stop):
                if self.fused_blocks:
                    res = layers[i](res, i, tap, ctx, kv_caches[i], meta)
                else:
                    res = Residual(layers[i](res.whole(tap), i, tap, ctx, kv_caches[i], meta))
        self.last_runs = runs
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step of %d rows: %s", x.shape[0], ", ".join(f"blocks {a}-{b - 1} {p}" for a, b, p in runs))
        if num_layers is not None and num_layers < len(self.layers):
            res.whole(tap)  # the last block's end points are still tapped
            return None
        if self.fused_blocks:
            return add_norm(self.norm, tap, res, out=(("final", PSEUDO_LAYER),))[1]
        return tap("final", PSEUDO_LAYER, self.norm(res.whole(tap)))

    def plan_runs(self, num_layers: int, tap: Tap, meta: AttentionMetadata, rows: int
                  ) -> tuple[tuple[int, int, str], ...]:
        """How blocks ``[0, num_layers)`` of this step run: maximal runs ``(start, stop, path)``.

        ``"stack"``: a decode step's blocks that no request taps, where the backend has the C++
        block runner and the family's blocks fit it; ``"fused"``: Python blocks on the backend's
        fused ops (tapped blocks, prefill steps); ``"eager"``: Python blocks on PyTorch alone.
        """
        stack = self.stack is not None and self.stack.applies(meta, rows)
        python = "fused" if self.backend is not None and self.backend.fused else "eager"
        runs: list[tuple[int, int, str]] = []
        for i in range(num_layers):
            path = "stack" if stack and self.stack.runs[i] and not tap.touches(i) else python
            if runs and runs[-1][2] == path:
                runs[-1] = (runs[-1][0], i + 1, path)
            else:
                runs.append((i, i + 1, path))
        return tuple(runs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] (model dtype) for the given final hidden rows."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.backend is not None and self.backend.linear is not None:
            logits = self.backend.linear.linear(hidden, self.embed_tokens.weight, None)
        elif self.backend is not None and self.backend.batch_invariant:
            logits = rowwise(lambda x: F.linear(x, self.embed_tokens.weight), hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def lens_logits(self, point: str, x: torch.Tensor) -> torch.Tensor:
        """The logit lens: logits from residual-stream states ``[N, hidden]`` (final norm, then unembedding)."""
        x = x.to(self.cfg.dtype)
        return self.compute_logits(x if point == "final" else self.norm(x))

    def use_backend(self, backend: Backend | None) -> None:
        """Hand every module the backend's ops of its family (``tapllm.backends.select_backend``);
        ``None`` (or the eager backend) restores the plain PyTorch code everywhere."""
        invariant = backend is not None and backend.batch_invariant
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | GatedMLP):
                module.ops = backend.elementwise if backend is not None else None
                if isinstance(module, Attention):
                    module.fused_kv_write = module.ops is not None and hasattr(module.ops, "rotary_kv_write")
                    module.opts = replace(module.opts, invariant=invariant)
                if isinstance(module, RMSNorm):
                    module.invariant = invariant
                # batch_invariant: a row's norm must not change kernel with whether another request taps the step
                site_op = next(name for kind, name in _SITE_OPS if isinstance(module, kind))
                module.fused_sites = (self.fused_blocks and module.ops is not None and hasattr(module.ops, site_op)
                                      and not invariant)
            elif isinstance(module, QuantLinear | QuantEmbedding):
                module.ops = backend.quant if backend is not None else None
            elif isinstance(module, Linear):
                module.use_gemv(backend.gemv if backend is not None else None,
                                backend.gemv_rows if backend is not None else 0, invariant)
                module.use_linear(backend.linear if backend is not None else None)
        self.backend = backend
        self.stack = DecoderStack.maybe(backend.stack if backend is not None else None, self.layers,
                                        self.stack_block, Attention, GatedMLP, invariant)

    # ---- weights -----------------------------------------------------------------------
    def prepare_for_inference(self, prepack: bool, pack_rows: int = 16) -> None:
        """After loading: prepack linear weights when the backend says so, for steps of ``pack_rows`` rows
        (see layers/linear.py);
        a quantized model's tied LM head shares the quantized embedding's blocks (or, with the
        embedding kept in float, is quantized from it)."""
        quant: Quantization | None = getattr(self, "quant", None)
        head_blocks = getattr(self, "head_blocks", None)  # a GGUF embedding's blocks, kept as stored
        if self.lm_head is None and isinstance(self.embed_tokens, QuantEmbedding):
            self.lm_head = self.embed_tokens.head()
        if self.lm_head is None and head_blocks is not None:
            self.lm_head = QuantLinear(self.cfg.hidden_size, self.cfg.vocab_size, False, self.cfg.dtype, quant,
                                       shape=tuple(head_blocks.shape[1:]))
            self.lm_head.load_rows(None, head_blocks)
            self.head_blocks = None
        if self.lm_head is None and quant is not None and block_shape(quant, self.cfg.hidden_size):
            self.lm_head = QuantLinear.from_weight(self.embed_tokens.weight.data, None, quant)
        if self.lm_head is None and prepack:
            self.lm_head = Linear(self.cfg.hidden_size, self.cfg.vocab_size, False, self.cfg.dtype)
            self.lm_head.weight.data = self.embed_tokens.weight.data
        if prepack:
            pack_linears(self, pack_rows)

    def checkpoint_names(self, name: str, tensor: torch.Tensor) -> Placement:
        """Where a checkpoint tensor goes: ``[(parameter, first row or None, tensor)]``; ``[]`` skips it.

        By default a leading ``model.`` is dropped and the names of :meth:`fused` map into
        their fused parameters at their row offsets.
        """
        name = name.removeprefix("model.")
        for src, dst, offset in self.fused():
            if f".{src}." in name:
                return [(name.replace(src, dst), offset, tensor)]
        return [(name, None, tensor)]

    def fused(self) -> list[tuple[str, str, int]]:
        """``(checkpoint module name, fused parameter's module name, row offset)``; none by default."""
        return []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters; ``ValueError`` names a bad shape or a missing tensor."""
        params = dict(self.named_parameters())
        # quantized layers take their weight rows through load_rows (no float copy is kept)
        split = [f"{n}." for n, m in self.named_modules() if isinstance(m, SplitQuantLinear)]  # fills its parts
        sinks = {f"{n}.weight": m for n, m in self.named_modules()
                 if isinstance(m, QuantLinear | SplitQuantLinear | QuantEmbedding) and not n.startswith(tuple(split))}
        filled: dict[str, int] = {}
        for name, tensor in weights:
            for target, offset, value in self.checkpoint_names(name, tensor):
                if target in sinks:
                    sinks[target].load_rows(offset, value)
                    filled[target] = filled.get(target, 0) + value.shape[0]
                    continue
                if target not in params:
                    continue  # e.g. lm_head.weight of a tied checkpoint, rotary buffers
                param = params[target].data
                dst = param if offset is None else param.narrow(0, offset, value.shape[0])
                if dst.shape != value.shape:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                dst.copy_(value)
                filled[target] = filled.get(target, 0) + value.shape[0]
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        missing += [n for n, m in sinks.items()
                    if filled.get(n, 0) != (m.num_embeddings if isinstance(m, QuantEmbedding) else m.out_features)]
        if missing:
            more = " ..." if len(missing) > 6 else ""
            raise ValueError(f"checkpoint is missing tensors for: {missing[:6]}{more}")


def qkv_fused(cfg: ModelConfig, q: str = "q_proj", k: str = "k_proj", v: str = "v_proj") -> list[tuple[str, str, int]]:
    """The row offsets of separate q/k/v projections inside ``qkv_proj``."""
    qs, kvs = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(q, "qkv_proj", 0), (k, "qkv_proj", qs), (v, "qkv_proj", qs + kvs)]


def gate_up_fused(inter: int, gate: str = "gate_proj", up: str = "up_proj") -> list[tuple[str, str, int]]:
    """The row offsets of separate gate/up projections inside ``gate_up_proj``."""
    return [(gate, "gate_up_proj", 0), (up, "gate_up_proj", inter)]
