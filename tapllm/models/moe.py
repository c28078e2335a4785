"""The sparse mixture-of-experts MLP, and what every MoE family shares on top of the Llama block.

A router (``gate``, a linear to one logit per expert) picks each token's top-k experts; the
families differ in their :class:`Routing` (renormalise the chosen probabilities or not, scale
in float32 or in the model's dtype) and in a shared expert that Qwen2-MoE adds, scaled by
``sigmoid(shared_expert_gate(x))``. The experts are computed grouped: the step's (token,
choice) pairs are sorted by expert once, and every expert that has rows runs one GEMM over
them (:mod:`tapllm.models.experts`: :func:`grouped_experts`, and with the CPU backend its packed
GEMV over the chosen experts' weights in place; with the CUDA backend two fused Triton kernels
that sort on the device, so decode steps run in CUDA graphs); no per-token Python.

The experts' weights are stacked, as transformers keeps them in memory: ``experts.gate_up_proj``
holds every expert's [gate; up] rows (stored ``[E * 2I, hidden]``, seen as ``[E, 2I, hidden]``)
and ``experts.down_proj`` every expert's down projection (``[E * hidden, I]``, seen as
``[E, hidden, I]``), so a checkpoint's per-expert tensors (``experts.N.gate_proj``, Mixtral's
``experts.N.w1/w2/w3``) load as row ranges, and stacked ones whole.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tapllm.backends import Backend
from tapllm.config import ModelConfig
from tapllm.layers.linear import Linear
from tapllm.models.base import GatedMLP, Placement, activation, kernel_activation, qkv_fused
from tapllm.models.experts import Activation, Experts, Glu, gated, grouped_experts
from tapllm.models.llama import LlamaForCausalLM
from tapllm.models.routing import Routing, dense_router_points, route, tapped_route
from tapllm.tap import Tap, no_tap

__all__ = ["Activation", "DenseMLP", "Experts", "Glu", "MoEForCausalLM", "Router", "Routing", "SparseMoE", "gated",
           "grouped_experts", "route"]


class Router(Linear):
    """A router's linear (and Qwen2-MoE's one-row shared-expert gate): kept in the model's dtype when the
    other linears are quantized (``quantize_linears`` takes plain :class:`Linear` modules only), as vLLM
    keeps MoE gates unquantized: a rounding there changes which experts run."""


class SparseMoE(nn.Module):
    """Router, top-k experts, and (Qwen2-MoE) a gated shared expert: what the MLP sublayer adds.

    ``router_logits`` ``[T, n_experts]`` passes through the tap (before the softmax); when the tap
    touches the block, the routing passes ``router_probs``, ``routing_weights`` and ``experts_chosen``
    through it too, and applies the router's steers (:func:`~tapllm.models.routing.tapped_route`);
    ``expert_out`` ``[T, n_experts, hidden]`` (each expert's output where the token is routed to it, 0
    elsewhere) is computed only where the tap wants it, and ``shared_expert_out`` (the gated shared
    expert's ``[T, hidden]``, steerable) passes through it. The shared expert's neurons are not a point
    (``mlp_post`` is a dense MLP's).
    """

    def __init__(self, cfg: ModelConfig, routing: Routing, inter: int, act: Activation,
                 shared_inter: int | None = None, glu: Glu | None = None, bias: bool = False) -> None:
        """``glu`` replaces ``act(gate) * up`` inside the experts; ``bias``: the router and the experts
        have biases (gpt-oss)."""
        super().__init__()
        self.routing = routing
        self.glu = glu if glu is not None else gated(act)
        self.kernel_act = kernel_activation(act) if glu is None else None  # act(gate) * up in one kernel
        self.gate = Router(cfg.hidden_size, routing.num_experts, bias, cfg.dtype)
        self.experts = Experts(routing.num_experts, cfg.hidden_size, inter, cfg.dtype, bias)
        self.shared_expert = GatedMLP(cfg, act, intermediate=shared_inter) if shared_inter else None
        self.shared_expert_gate = Router(cfg.hidden_size, 1, False, cfg.dtype) if shared_inter else None

    def forward(self, x: torch.Tensor, tap: Tap = no_tap, i: int = 0) -> torch.Tensor:
        raw = self.gate(x)
        if tap.touches(i):  # steers at the router keep its logits as computed: a forced expert's weight
            logits = tap("router_logits", i, raw.clone() if tap.steers("router_logits", i) else raw)
            weights, ids = tapped_route(raw, logits, self.routing, tap, i)
            if tap.wants("expert_out", i):
                keep = x.new_zeros((x.shape[0], self.routing.num_experts, x.shape[1]))
                out = self.experts(x, weights, ids, self.glu, keep)
                tap("expert_out", i, keep)
            else:
                out = self.experts(x, weights, ids, self.glu)
        else:
            weights, ids = route(tap("router_logits", i, raw), self.routing)
            out = self.experts(x, weights, ids, self.glu)
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = out + (tap("shared_expert_out", i, shared) if tap.touches(i) else shared)
        return out


class DenseMLP(GatedMLP):
    """A dense block's gated MLP inside a mixture-of-experts model (Qwen-MoE's ``mlp_only_layers``): no
    ``mlp_post`` point, which a model exposes only where every block has the same neurons; its
    router points, ``expert_out`` and ``shared_expert_out`` are NaN (the block has no router or experts), so a
    capture over every block keeps its shape."""

    def __init__(self, cfg: ModelConfig, act: Activation, num_experts: int) -> None:
        super().__init__(cfg, act)
        self.num_experts = num_experts

    def forward(self, x: torch.Tensor, tap: Tap = no_tap, i: int = 0) -> torch.Tensor:
        if tap.touches(i):
            dense_router_points(x, self.num_experts, tap, i)
        return super().forward(x)


# A checkpoint's per-expert tensor: its module prefix, expert index and projection.
_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_HALVES = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate|up)_exps$")  # GGUF: every expert's gate (or up), [E, I, H]
_GATED = re.compile(r"(layers\.\d+\.mlp(?:\.shared_expert)?)\.(gate_proj|up_proj)\.(weight|bias)$")
# projection -> (stacked parameter, half of an expert's gate_up rows or None)
_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
          "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


class MoEForCausalLM(LlamaForCausalLM):
    """A pre-norm Llama-style decoder whose MLPs are :class:`SparseMoE` blocks (dense ones where the
    family says, :meth:`is_sparse`). A family sets :meth:`routing`, :meth:`expert_size` and, with a
    shared expert, :meth:`shared_expert_size`."""

    stack_block = None  # the C++ block runner takes dense gated MLPs only: these blocks run in Python

    @property
    def graphs_off(self) -> str | None:
        """Why its steps cannot be CUDA graphs: where some block's experts run the grouped path (no fused
        kernels on the backend, or experts they do not take), that path reads row counts on the host."""
        if all(m.experts.host_free for m in self.modules() if isinstance(m, SparseMoE)):
            return None
        return "reads its experts' row counts on the host every step (the grouped path: " + self._grouped_why() + ")"

    def _grouped_why(self) -> str:
        if self.backend is None or self.backend.moe is None:
            return "the backend has no fused expert kernels"
        return "biased experts or a gated activation the fused kernels do not compute"

    def routing(self) -> Routing:
        """The family's routing, from its config."""
        raise NotImplementedError

    def expert_size(self) -> int:
        """One expert's hidden width."""
        return int(self.cfg.hf_config.intermediate_size)

    def shared_expert_size(self) -> int | None:
        """The shared expert's width, or None when the family has none."""
        return None

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP is a mixture of experts (every block's by default)."""
        return True

    def block_mlp(self, layer: int) -> nn.Module:
        act = activation(getattr(self.cfg.hf_config, "hidden_act", "silu"))
        routing = self.routing()
        if not self.is_sparse(layer):
            return DenseMLP(self.cfg, act, routing.num_experts)
        return SparseMoE(self.cfg, routing, self.expert_size(), act, self.shared_expert_size())

    def use_backend(self, backend: Backend | None) -> None:
        """As :meth:`CausalLM.use_backend`, and the experts on the backend's packed GEMV where it has one
        (:meth:`Experts.use_gemv`); ``ValueError`` for a batch-invariant backend, which the grouped
        expert GEMMs (rows of other requests in one call) are not."""
        if backend is not None and backend.batch_invariant:
            raise ValueError(f"batch_invariant=True is not supported for {self.cfg.architecture} yet: its experts "
                             "run one GEMM over the rows of every request routed to them")
        super().use_backend(backend)
        gemv = backend.gemv if backend is not None else None
        elementwise = backend.elementwise if backend is not None else None
        fused = backend.moe if backend is not None else None
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.experts.use_gemv(gemv, elementwise, module.kernel_act)
                module.experts.use_fused(fused, module.kernel_act)

    def fused(self) -> list[tuple[str, str, int]]:
        return qkv_fused(self.cfg)  # gate/up rows are placed by checkpoint_names: their widths differ by module

    def checkpoint_names(self, name: str, tensor: torch.Tensor) -> Placement:
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if (m := _EXPERT.match(name)) and m.group(3) in _PARTS:
            experts = self.get_submodule(m.group(1))
            target, half = _PARTS[m.group(3)]
            e = int(m.group(2))
            offset = e * experts.hidden if half is None else (2 * e + half) * experts.inter
            return [(f"{m.group(1)}.{target}", offset, tensor)]
        if m := _HALVES.match(name):
            inter, half = tensor.shape[1], 0 if m.group(2) == "gate" else 1
            return [(f"{m.group(1)}.gate_up_proj", (2 * e + half) * inter, tensor[e]) for e in range(tensor.shape[0])]
        if _STACKED.match(name):  # transformers' in-memory layout, [E, rows, cols]
            return [(name, None, tensor.reshape(-1, tensor.shape[-1]))]
        if m := _GATED.match(name):
            mlp = self.get_submodule(m.group(1))
            return [(f"{m.group(1)}.gate_up_proj.{m.group(3)}", 0 if m.group(2) == "gate_proj" else mlp.inter,
                     tensor)]
        return super().checkpoint_names(name, tensor)
