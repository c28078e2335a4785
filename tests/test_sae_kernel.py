"""SAE features through the fused Triton kernel (Triton's interpreter here) equal the PyTorch encode, and a
graph step's SAE work is a fixed number of ops whatever the batch.

The reference is the PyTorch path a group takes without the kernel (``eager_pack``: the SAE's own
``encode_and_reconstruct``, the error norm, one ``topk``), checked itself against ``SAE.encode``/``decode``.
"""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import random_prompts
from helpers import assert_close
from tapllm import LLM, SAE, HiddenStatesSpec, SamplingParams
from tapllm.kernels import triton_sae
from tapllm.sae.batch import PackLayout, eager_pack, fused_pack, kernel_k
from tapllm.sae.sae_config import SAEConfig

pytestmark = pytest.mark.skipif(not triton_sae.available(torch.device("cpu")),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

D = 64


def _sae(arch: str, d_sae: int = 256, *, k: int = 24, seed: int = 0, transcoder: bool = False, skip: bool = False,
         apply_b_dec: bool = True, sparse: bool = False) -> SAE:
    g = torch.Generator().manual_seed(seed)
    extra = {}
    if arch == "jumprelu":
        extra["threshold"] = torch.rand(d_sae, generator=g) * 0.5
    if arch == "gated":
        extra.update(b_gate=torch.randn(d_sae, generator=g) * 0.2, b_mag=torch.randn(d_sae, generator=g) * 0.2,
                     r_mag=torch.randn(d_sae, generator=g) * 0.2)
    if skip:
        extra["W_skip"] = torch.randn(D, D, generator=g) * 0.05
    out = "mlp_out" if transcoder or skip else None
    cfg = SAEConfig(arch, D, d_sae, "resid_post", 1, k=k if arch == "topk" else None, apply_b_dec_to_input=apply_b_dec,
                    out_point=out, out_layer=1 if out else None)
    b_enc = torch.randn(d_sae, generator=g) * 0.1 - (2.0 if sparse else 0.0)
    return SAE(cfg, torch.randn(D, d_sae, generator=g) * 0.3, b_enc, torch.randn(d_sae, D, generator=g) * 0.1,
               torch.randn(D, generator=g) * 0.1, **extra)


def _sels(sae: SAE, ks: list[int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(sae=sae, mode="topk", k=k, ids=None) for k in ks]


def _fields(pack: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return pack[:, :k], pack[:, k : 2 * k].view(torch.float32), pack[:, 2 * k].view(torch.float32)


def _check(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """Same ids (where the latent is clearly active: zeros tie), values within rounding, same error norms."""
    ids, vals, err = _fields(got, k)
    ids_w, vals_w, err_w = _fields(want, k)
    assert_close(vals, vals_w, 1e-5)
    assert_close(err, err_w, 1e-5)
    active = vals_w > 1e-4
    assert torch.equal(ids[active], ids_w[active])
    assert bool((vals[:, :-1] >= vals[:, 1:]).all())  # largest first


@pytest.mark.parametrize("arch, ks", [("topk", [24]), ("topk", [4, 16]), ("topk", [1]), ("standard", [16]),
                                      ("standard", [3, 40]), ("jumprelu", [8]), ("jumprelu", [1, 32])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_pack_equals_the_pytorch_encode(arch, ks, dtype):
    sae = _sae(arch, seed=len(ks))
    x = (torch.randn(7, D, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    sels = _sels(sae, ks)
    k = kernel_k(sae, sels)
    assert k == max(ks)
    want = eager_pack(sae, x, None, PackLayout(sels))
    _check(fused_pack(sae, x, None, k), want, k)
    # the reference itself: SAE.encode / decode
    z = sae.encode(x.float())
    top = torch.topk(z, k)
    assert_close(_fields(want, k)[1], top.values)
    assert_close(_fields(want, k)[2], (x.float() - sae.decode(z)).norm(dim=-1))


@pytest.mark.parametrize("arch", ["topk", "standard", "jumprelu"])
def test_fused_pack_over_many_tiles(arch, monkeypatch):
    """The GPU's tiles (many per row): ties broken across tiles, inactive tiles skipped, decode in column tiles."""
    monkeypatch.setattr(triton_sae, "INTERPRETER_TILE", 0)
    sae = _sae(arch, d_sae=1100, k=40, seed=5, sparse=arch != "topk")
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    x[1] = sae.b_dec  # standard/jumprelu: few (or no) active latents, the top-k padded with tied zeros
    sels = _sels(sae, [20])
    _check(fused_pack(sae, x, None, 20), eager_pack(sae, x, None, PackLayout(sels)), 20)


def test_fused_pack_options():
    """No b_dec subtraction; a transcoder's target (bfloat16); a skip connection."""
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(8))
    target = torch.randn(5, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    cases = [(_sae("topk", apply_b_dec=False), None), (_sae("jumprelu", transcoder=True, seed=2), target),
             (_sae("topk", skip=True, seed=3), torch.randn(5, D, generator=torch.Generator().manual_seed(10)))]
    for sae, tgt in cases:
        sels = _sels(sae, [10])
        _check(fused_pack(sae, x, tgt, 10), eager_pack(sae, x, tgt, PackLayout(sels)), 10)


def test_what_the_kernel_does_not_serve_stays_in_pytorch():
    topk = _sae("topk", k=8)
    assert kernel_k(topk, _sels(topk, [9])) is None  # more than the SAE's own k
    gated = _sae("gated")
    assert kernel_k(gated, _sels(gated, [4])) is None
    norm = _sae("standard")
    norm.cfg.normalize_activations = "layer_norm"
    assert kernel_k(norm, _sels(norm, [4])) is None
    dense = _sae("standard")
    assert kernel_k(dense, [SimpleNamespace(sae=dense, mode="all", k=0, ids=None)]) is None
    assert kernel_k(dense, _sels(dense, [triton_sae.MAX_K + 1])) is None


# ---- through the engine -------------------------------------------------------------------------------
def _graphed(folder, **kw) -> LLM:
    return LLM(folder, dtype="float32", backend="cuda", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
               cuda_graph_token_sizes=[16, 32, 64], max_num_batched_tokens=64, **kw)


def test_graph_steps_give_the_features_of_the_eager_cpu_step(tiny_models):
    """Requests of one SAE (top-k of several k, the last position, a listed-ids request that keeps the group
    in PyTorch) and of a gated SAE, through graph steps and the CUDA backend's eager steps, equal the CPU
    backend's features."""
    folder = tiny_models["llama"]
    topk, gated = _sae("topk", seed=1), _sae("gated", seed=2)
    twin = SAE(topk.cfg, topk.W_enc, topk.b_enc, topk.W_dec, topk.b_dec)  # the same weights: one device SAE
    specs = [HiddenStatesSpec(sae=topk, features="topk:8", positions="all"),
             HiddenStatesSpec(sae=topk, features="topk:3", positions="generated"),
             HiddenStatesSpec(sae=twin, features="topk:5", positions="last"),
             HiddenStatesSpec(sae=gated, features="topk:6", positions="all"),
             HiddenStatesSpec(sae=_sae("standard", seed=4), features=[3, 7, 200], positions="all"),
             HiddenStatesSpec(sae=_sae("standard", seed=4), features="topk:4", positions="all")]
    prompts = random_prompts([5, 9, 3, 7, 6, 4], seed=21)
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, hidden_states=s) for s in specs]
    want = LLM(folder, dtype="float32", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    graphed = _graphed(folder)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert graphed.engine.runner.policy.graph_steps > 0
    # an eager step of the CUDA backend (an attention pattern captured beside): the same batched code
    eager_spec = [HiddenStatesSpec(layers=[0], points="attn_pattern", positions="last")] + specs[:1]
    extra = graphed.generate(prompts[:2], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                          hidden_states=s) for s in eager_spec], use_tqdm=False)
    assert graphed.engine.runner.policy.eager_steps["attention patterns are captured"] > 0
    solo = LLM(folder, dtype="float32", enforce_eager=True).generate(prompts[1:2], SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True, hidden_states=specs[0]), use_tqdm=False)
    for a, b in [*zip(want, got), (solo[0], extra[1])]:
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        fa, fb = a.hidden_states.features, b.hidden_states.features
        assert torch.equal(fa.positions, fb.positions)
        for name, t in fa.tensors().items():
            u = fb.tensors()[name]
            assert u.dtype == t.dtype, name
            if name == "ids":
                active = fa.values > 1e-4
                assert torch.equal(u[active], t[active])
            else:
                assert_close(u, t, 1e-5)


def _step_budget():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "step_budget.py"
    spec = importlib.util.spec_from_file_location("step_budget_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_graph_step_s_sae_work_does_not_grow_with_the_batch(tiny_models):
    """Ops outside the graph in one decode step (benchmarks/step_budget.py's count), every request asking
    one SAE's top-8: the same at batch 1 and 8, and at most 8 more than a plain step."""
    from tapllm.kernels import triton_attention, triton_elementwise, triton_tap

    sb = _step_budget()
    sb.TRITON = sb.TritonCount([m._kernels() for m in (triton_attention, triton_elementwise, triton_tap, triton_sae)])
    try:
        llm = _graphed(tiny_models["llama"], enable_prefix_caching=False, max_model_len=256)
        sae = _sae("topk", seed=6)
        cases = {"plain": lambda i: SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                 "sae": lambda i: SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                                                 hidden_states=HiddenStatesSpec(sae=sae, features="topk:8",
                                                                                positions="all"))}
        args = Namespace(prompt_len=4, timed_steps=1, interpreted_timing=False)
        ops = {(case, b): sb.measure_step(llm, make, b, 100 + b, args) for case, make in cases.items() for b in (1, 8)}
    finally:
        sb.TRITON.restore()
    for b in (1, 8):
        assert ops[("sae", b)]["ops"].get("sae_features_kernel") == 1
        assert ops[("sae", b)]["host_ops"] <= ops[("plain", b)]["host_ops"] + 8, ops[("sae", b)]["ops"]
    assert ops[("sae", 1)]["host_ops"] == ops[("sae", 8)]["host_ops"], (ops[("sae", 1)]["ops"], ops[("sae", 8)]["ops"])
