"""The experts of a mixture-of-experts block, computed grouped: every expert's weights read once per step.

A step's ``T * top_k`` (token, choice) pairs are sorted by expert once (a stable argsort of the chosen
ids, row counts from a bincount); every expert with rows runs one GEMM over its contiguous rows on its
slice of the stacked weights (no copy), and the weighted rows are added back to their tokens
(``index_add_``). No per-token Python: the loop runs over the experts that were hit, so a batch-1
decode step reads the ``top_k`` chosen experts' weights and no others.

The weights are stacked, as transformers keeps them in memory: ``gate_up_proj`` holds every expert's
[gate; up] rows (stored ``[E * 2I, hidden]``, seen as ``[E, 2I, hidden]``; gate and up in one GEMM)
and ``down_proj`` every expert's down projection (``[E * hidden, I]``, seen as ``[E, hidden, I]``).

Three paths compute them:

* plain PyTorch (:func:`grouped_experts`): ``F.linear`` on each expert's ``[out, in]`` slice. On CPU
  oneDNN reorders a plain bf16 weight on every call, which reads and writes it: about half the
  memory bandwidth a decode step could have;
* with the CPU backend's packed GEMV (:meth:`Experts.use_gemv`, the same probed kernel the dense
  linears read, :mod:`tapllm.kernels.gemv`): the stacked weights are laid out once, at load, in
  that kernel's blocked layout (:func:`blocked`: per expert, blocks of 64 outputs x input pairs, the
  operand of ``vdpbf16ps``; float32: 64 outputs x inputs), so each expert's rows read its weights in
  place at the bandwidth of a GEMV, at every row count (past ``GEMV_MAX_ROWS`` the kernel tiles the
  rows). The layout is tapllm's own (not oneDNN's choice), checked against ``F.linear`` on one expert
  when it is made; the plain weights are dropped (one copy in memory) and restored by ``use_gemv(None)``.
  With the fused gated activation (SiLU or GELU-tanh, no biases) the loop over experts is one C++ call,
  ``moe_experts`` (csrc/moe_experts.cpp: the same ops in the same order, no Python dispatch per expert);
* with the CUDA backend's fused kernels (:meth:`Experts.use_fused`, :mod:`tapllm.kernels.triton_moe`):
  the pairs sorted by expert on the device into blocks of one expert each, padded, with static shapes,
  and two Triton kernels over the blocks, so nothing is read on the host and a CUDA graph holds the
  step. They take the gated SiLU/GELU-tanh without biases (not gpt-oss's experts, which keep the
  grouped path: its row counts are read on the host, so those steps are no graphs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.backends.ops import ElementwiseOps, GemvOps, MoEOps

Activation = Callable[[torch.Tensor], torch.Tensor]
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> what the down projection reads
# (rows, expert) -> the rows through that expert's gate/up, glu and down projections.
ExpertFn = Callable[[torch.Tensor, int], torch.Tensor]

BLOCK_N = 64  # outputs per block of the packed GEMV's layout (csrc/packed_gemv.cpp)
BLOCK_K = {torch.bfloat16: 32, torch.float32: 16}  # its inputs are padded to a multiple of this


def gated(act: Activation) -> Glu:
    """The usual gated activation, ``act(gate) * up`` (SwiGLU with SiLU)."""
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(gate) * up
    glu.act = act  # the activation a fused kernel may compute instead (Experts.use_gemv)
    return glu


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def sorted_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(order, tokens, counts)`` of the ``[T, top_k]`` chosen ``ids``: the pairs sorted by expert (stable, so
    each expert's rows keep token order), each sorted pair's token, and every expert's row count."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one read on the host per block
    return order, order // ids.shape[1], counts


def combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int, expert: ExpertFn,
            keep: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert(x[t], ids[t, j])`` over the rows of ``x`` ``[T, hidden]``: one call of
    ``expert`` per expert with rows, on those rows (contiguous, in token order). ``keep`` ``[T, n_experts,
    hidden]`` (zeros) receives each expert's output at the tokens routed to it, before its weight."""
    order, tokens, counts = sorted_pairs(ids, num_experts)
    hit = [e for e, n in enumerate(counts) if n]
    parts = x.index_select(0, tokens).split([counts[e] for e in hit])
    outs = [expert(rows, e) for rows, e in zip(parts, hit, strict=True)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if keep is not None:
        keep[tokens, ids.reshape(-1)[order]] = out.to(keep.dtype)
    scaled = (out * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, glu: Glu, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every row ``t`` of ``x`` ``[T, hidden]``.

    ``gate_up`` is ``[E, 2I, hidden]`` and ``down`` ``[E, hidden, I]`` (biases, where the family has
    them, ``[E, 2I]`` and ``[E, hidden]``); an expert is ``down(glu(gate(x), up(x)))``, one GEMM pair
    over its rows (:func:`combine`, which fills ``keep`` where given).
    """
    inter = down.shape[-1]

    def expert(rows: torch.Tensor, e: int) -> torch.Tensor:
        h = F.linear(rows, gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        return F.linear(glu(h[:, :inter], h[:, inter:]), down[e], None if down_bias is None else down_bias[e])

    return combine(x, weights, ids, gate_up.shape[0], expert, keep)


def blocked(w: torch.Tensor) -> torch.Tensor:
    """Stacked weights ``[E, N, K]`` (bfloat16 or float32) in the packed GEMV's layout, ``[E, N, Kpad]``: expert
    ``e``'s slice is a weight ``packed_linear`` reads (its storage runs on past row N to the padded blocks)."""
    e, n, k = w.shape
    npad, kpad = _round_up(n, BLOCK_N), _round_up(k, BLOCK_K[w.dtype])
    if (npad, kpad) != (n, k):  # (a real model's shapes need no padding: no extra copy at load)
        w = F.pad(w, (0, kpad - k, 0, npad - n))
    if w.dtype == torch.bfloat16:  # [E, blocks, input pairs, 64 outputs, 2 inputs]
        w = w.view(e, npad // BLOCK_N, BLOCK_N, kpad // 2, 2).permute(0, 1, 3, 2, 4)
    else:  # [E, blocks, inputs, 64 outputs]
        w = w.view(e, npad // BLOCK_N, BLOCK_N, kpad).permute(0, 1, 3, 2)
    return w.contiguous().view(e, npad, kpad)[:, :n]


def unblocked(b: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`blocked`'s inverse: ``[E, N, K]`` plain rows from ``[E, N, Kpad]`` blocked ones."""
    e, n, kpad = b.shape
    npad = b.stride(0) // kpad
    full = b.as_strided((e, npad, kpad), (npad * kpad, kpad, 1))
    if b.dtype == torch.bfloat16:
        w = full.reshape(e, npad // BLOCK_N, kpad // 2, BLOCK_N, 2).permute(0, 1, 3, 2, 4)
    else:
        w = full.reshape(e, npad // BLOCK_N, kpad, BLOCK_N).permute(0, 1, 3, 2)
    return w.reshape(e, npad, kpad)[:, :n, :k].contiguous()


class Experts(nn.Module):
    """Every expert's weights, stacked (see the module docstring), and the grouped computation over them."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * inter, hidden, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden, inter, dtype=dtype), requires_grad=False)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:  # gpt-oss: [E, 2I] ([gate; up] as the weights) and [E, hidden]
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter, dtype=dtype),
                                                  requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        # With the packed GEMV (use_gemv): the weights in its layout, [E, 2I, Hpad] and [E, hidden, Ipad].
        self.gemv: GemvOps | None = None
        self.packed_gate_up: torch.Tensor | None = None
        self.packed_down: torch.Tensor | None = None
        # The same per expert (views, taken once: indexing a tensor in the step costs a dispatch).
        self.expert_gate_up: tuple[torch.Tensor, ...] | None = None
        self.expert_down: tuple[torch.Tensor, ...] | None = None
        self.act_ops: ElementwiseOps | None = None  # the fused gated activation (gated SiLU/GELU only)
        self.kernel_act: int | None = None
        self.moe: MoEOps | None = None  # the fused expert kernels (CUDA backend; see use_fused)

    def use_fused(self, ops: MoEOps | None, kernel_act: int | None) -> None:
        """Compute the experts with ``ops``'s fused kernels (no value read on the host, so a CUDA graph holds
        the step) where they apply: a gated activation they compute (``kernel_act``) and no biases; None,
        or experts they do not take, keep the grouped path."""
        takes = ops is not None and kernel_act is not None and self.gate_up_proj_bias is None
        self.moe = ops if takes else None
        if takes:
            self.kernel_act = kernel_act

    @property
    def host_free(self) -> bool:
        """Whether a step reads nothing of these experts on the host (the fused kernels compute them)."""
        return self.moe is not None

    def use_gemv(self, ops: GemvOps | None, act_ops: ElementwiseOps | None = None, kernel_act: int | None = None
                 ) -> None:
        """Compute the experts with ``ops``'s packed GEMV (the backend's, probed for the weights' dtype), the
        weights laid out for it once; None restores the plain weights and ``F.linear``. ``act_ops`` with
        ``kernel_act``: the gated activation in one kernel (where the family's glu is ``act(gate) * up``)."""
        e, h, i = self.num_experts, self.hidden, self.inter
        if ops is None or self.gate_up_proj is None or self.gate_up_proj.dtype not in BLOCK_K:
            if ops is None and self.packed_gate_up is not None:  # back to the plain weights
                self.gate_up_proj = nn.Parameter(unblocked(self.packed_gate_up, h).view(e * 2 * i, h),
                                                 requires_grad=False)
                self.down_proj = nn.Parameter(unblocked(self.packed_down, i).view(e * h, i), requires_grad=False)
                self.packed_gate_up = self.packed_down = self.expert_gate_up = self.expert_down = None
            self.gemv = ops if self.packed_gate_up is not None else None
            self.act_ops, self.kernel_act = act_ops, kernel_act
            return
        gate_up, down = self.gate_up_proj.view(e, 2 * i, h), self.down_proj.view(e, h, i)
        packed_gate_up, packed_down = blocked(gate_up), blocked(down)
        if not _reads(ops, packed_gate_up, gate_up) or not _reads(ops, packed_down, down):
            return  # the kernel does not read this layout here: the plain path
        self.packed_gate_up, self.packed_down = packed_gate_up, packed_down
        self.expert_gate_up, self.expert_down = packed_gate_up.unbind(0), packed_down.unbind(0)
        self.gate_up_proj = self.down_proj = None  # one copy of the weights kept
        self.gemv, self.act_ops, self.kernel_act = ops, act_ops, kernel_act

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, glu: Glu,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """The weighted sum of each row's chosen experts; ``keep`` ``[T, E, hidden]`` (zeros) receives each
        expert's own output where the token is routed to it (the Python loop then runs, not ``moe_experts``,
        which keeps no per-expert rows: the same ops in the same order)."""
        e, h, i = self.num_experts, self.hidden, self.inter
        if self.moe is not None and keep is None and self.gate_up_proj is not None and x.dtype == self.gate_up_proj.dtype:
            return self.moe.fused_experts(x, weights, ids, self.gate_up_proj.view(e, 2 * i, h),
                                          self.down_proj.view(e, h, i), self.kernel_act)
        if self.gemv is None or x.dtype != self.packed_gate_up.dtype:
            gate_up, down = self.plain()
            return grouped_experts(x, weights, ids, gate_up, down, glu, self.gate_up_proj_bias, self.down_proj_bias,
                                   keep)
        gu_bias, d_bias = self.gate_up_proj_bias, self.down_proj_bias
        fused = self.act_ops is not None and self.kernel_act is not None
        if fused and gu_bias is None and keep is None and hasattr(self.gemv, "moe_experts"):  # the loop below in C++
            return self.gemv.moe_experts(x, weights, ids, self.packed_gate_up, self.packed_down, self.kernel_act)
        ops, gate_up, down = self.gemv, self.expert_gate_up, self.expert_down

        def expert(rows: torch.Tensor, n: int) -> torch.Tensor:
            g = ops.packed_linear(rows, gate_up[n], None if gu_bias is None else gu_bias[n])
            a = self.act_ops.gated_act(g, self.kernel_act) if fused else glu(g[:, :i], g[:, i:])
            return ops.packed_linear(a, down[n], None if d_bias is None else d_bias[n])

        return combine(x, weights, ids, e, expert, keep)

    @property
    def dtype(self) -> torch.dtype:
        """The experts' weights' dtype (packed or not)."""
        return (self.packed_gate_up if self.gate_up_proj is None else self.gate_up_proj).dtype

    def plain(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked weights as ``[E, 2I, hidden]`` and ``[E, hidden, I]`` (unpacked if they are packed)."""
        e, h, i = self.num_experts, self.hidden, self.inter
        if self.gate_up_proj is None:
            return unblocked(self.packed_gate_up, h), unblocked(self.packed_down, i)
        return self.gate_up_proj.view(e, 2 * i, h), self.down_proj.view(e, h, i)


def _reads(ops: GemvOps, packed: torch.Tensor, plain: torch.Tensor) -> bool:
    """Whether ``ops.packed_linear`` over the first expert's blocked weights agrees with ``F.linear`` over its
    plain ones (a wrong layout is off by order 1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, plain.shape[-1], generator=g).to(plain.dtype)
    want = F.linear(x, plain[0]).float()
    try:
        got = ops.packed_linear(x, packed[0], None).float()
    except RuntimeError:
        return False
    tol = 1e-2 if plain.dtype == torch.bfloat16 else 1e-4
    return bool(((got - want).norm() <= tol * want.norm() + 1e-6).item())
