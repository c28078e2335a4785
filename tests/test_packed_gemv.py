"""The in-place GEMV on oneDNN-packed bf16 and float32 weights (tapllm/kernels/gemv.py) against oneDNN and
float32, its probe, and the fused step with it on against the same step with it off.

The kernel runs only on CPUs with AVX512-BF16 whose oneDNN packs bf16 weights in the layout it
reads; elsewhere these tests check that the probe keeps oneDNN's call.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.kernels import fused_kernels, gemv
from tapllm.layers.linear import Linear
from tapllm.utils.platform import cpu_support

ops = fused_kernels()
gemv_ops = gemv.packed_gemv_ops(ops)
needs_gemv = pytest.mark.skipif(gemv_ops is None, reason="no AVX512-BF16 packed GEMV on this CPU")
ROWS = gemv.pack_rows(ops, torch.bfloat16)  # the row count the engine packs bf16 weights for here


@needs_gemv
@pytest.mark.parametrize("n,k", [(1, 64), (63, 32), (64, 576), (130, 33), (200, 1536), (49, 7), (520, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 30, 64, 65, 301])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_onednn_on_the_same_packed_weight(n, k, rows, bias):
    """Where the layout check says the kernel reads the packing (oneDNN's layout for a shape can change with
    the thread count and the CPU), the GEMV equals oneDNN; where it says not, the GEMV's result is wrong."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS)
    view = gemv_ops.packed_view(packed)
    got = gemv_ops.packed_linear(x, view, b).float()
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [None], "").float()
    exact = x.float() @ w.float().T + (b.float() if bias else 0)
    assert got.shape == (rows, n)
    if not gemv.reads(view, gemv.sample_entries(w)):
        assert ((got - exact).norm() / exact.norm()).item() > 0.1  # another layout: the check was right
        return
    # both round float32 sums to bf16: at most an ulp of bf16 (2^-8 relative) apart, plus summation order
    torch.testing.assert_close(got, exact, rtol=8e-3, atol=1e-3 * exact.abs().max().item())
    torch.testing.assert_close(got, onednn, rtol=8e-3, atol=1e-3 * exact.abs().max().item())


gemv_f32 = gemv.packed_gemv_ops(ops, torch.float32)


@pytest.mark.skipif(gemv_f32 is None, reason="no AVX512 packed float32 GEMV on this CPU")
@pytest.mark.parametrize("n,k", [(2, 64), (63, 16), (130, 33), (200, 1536), (49, 7), (520, 96)])
@pytest.mark.parametrize("rows", [1, 4, 5, 16, 30, 64, 65, 301])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_gemv_equals_onednn_on_the_same_packed_weight(n, k, rows, bias):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    got = gemv_f32.packed_linear(x, gemv_f32.packed_view(packed), b)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [None], "")
    exact = (x.double() @ w.double().T + (b.double() if bias else 0)).float()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * k**0.5)  # summation order only
    torch.testing.assert_close(got, onednn, rtol=1e-5, atol=1e-5 * k**0.5)


@needs_gemv
def test_gemv_refuses_mismatched_inputs():
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 96).to(torch.bfloat16), ROWS)
    view = gemv_ops.packed_view(packed)
    assert tuple(view.shape) == (64, 96)
    with pytest.raises(RuntimeError, match="inputs"):
        gemv_ops.packed_linear(torch.randn(1, 40).to(torch.bfloat16), view, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemv_ops.packed_linear(torch.randn(1, 96), view, None)
    with pytest.raises(RuntimeError, match="bias"):
        gemv_ops.packed_linear(torch.randn(1, 96).to(torch.bfloat16), view, torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="oneDNN-packed"):
        gemv_ops.packed_view(torch.randn(64, 96).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(130, 72), (576, 576), (576, 1536)])
def test_a_rows_result_does_not_depend_on_the_rows_around_it(dtype, n, k):
    """batch_invariant's linears: any number of rows (past 64 in passes of 6, in tiles that fit L2),
    each row bit for bit what it is alone."""
    g_ops = gemv.packed_gemv_ops(ops, dtype)
    if g_ops is None:
        pytest.skip(f"no packed {dtype} GEMV on this CPU")
    g = torch.Generator().manual_seed(k)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g).to(dtype),
                                                     gemv.pack_rows(ops, dtype))
    view, bias = g_ops.packed_view(packed), torch.randn(n, generator=g).to(dtype)
    x = torch.randn(700, k, generator=g).to(dtype)
    alone = torch.cat([g_ops.packed_linear(x[i : i + 1], view, bias) for i in range(x.shape[0])])
    for first, rows in ((0, 700), (3, 65), (100, 7), (1, 600), (650, 50)):
        assert torch.equal(g_ops.packed_linear(x[first : first + rows], view, bias), alone[first : first + rows])


@needs_gemv
def test_the_view_keeps_the_packed_weight_alive():
    w = torch.randn(70, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    view = gemv_ops.packed_view(torch.ops.mkldnn._reorder_linear_weight(w, ROWS))  # the packed tensor is dropped
    torch.randn(70, 64).to(torch.bfloat16)  # allocations that could reuse freed memory
    got = gemv_ops.packed_linear(x, view, None).float()
    torch.testing.assert_close(got, x.float() @ w.float().T, rtol=8e-3, atol=1e-2)


@pytest.mark.skipif(ops is None or not ops.packed_gemv_supported() or
                    torch.bfloat16 not in cpu_support().packable,
                    reason="no AVX512-BF16 in this build or CPU, or no bf16 packing")
def test_the_bf16_gemv_runs_wherever_the_cpu_has_avx512_bf16():
    """Where oneDNN packs for 16 rows a layout the kernel does not read (an AMX CPU's tile layout), the
    engine packs for one row, which it does: the probe passes either way, and a weight packed the
    engine's way is read in place."""
    assert gemv_ops is not None, gemv.packed_gemv_status(ops, torch.bfloat16)
    w = torch.randn(130, 72).to(torch.bfloat16)
    sixteen = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    try:
        gemv_ops.packed_view(sixteen)
        assert ROWS == 16  # the 16-row layout is read: kept (oneDNN's layout for prefill)
    except RuntimeError as exc:
        assert "blocked layout" in str(exc) and ROWS == 1
    lin = Linear(72, 130, bias=False, dtype=torch.bfloat16)
    lin.weight.data = w
    lin.pack(ROWS)
    lin.use_gemv(gemv_ops, gemv.MAX_ROWS)
    assert lin.gemv is not None
    for rows in (1, 7, 64, 65, 300):  # the GEMV, then oneDNN on the same packing
        x = torch.randn(rows, 72).to(torch.bfloat16)
        torch.testing.assert_close(lin(x).float(), x.float() @ w.float().T, rtol=8e-3, atol=3e-2)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


@pytest.mark.skipif(ops is None, reason="no C++ compiler: only the eager step exists here")
def test_turned_off_or_on_a_cpu_without_avx512_bf16_the_probe_keeps_onednn():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from tapllm.kernels import fused_kernels, gemv\n"
            "import torch\n"
            "assert gemv.packed_gemv_ops(fused_kernels()) is None\n"
            "assert gemv.packed_gemv_ops(fused_kernels(), torch.float32) is None\n")
    off = _python(code, TAPLLM_PACKED_GEMV="0")
    assert off.returncode == 0 and "TAPLLM_PACKED_GEMV=0" in off.stderr, off.stderr[-2000:]
    avx2 = _python(code, ATEN_CPU_CAPABILITY="avx2")  # the AVX2 build has no bf16 dot products
    assert avx2.returncode == 0 and "no AVX512-BF16" in avx2.stderr, avx2.stderr[-2000:]
    assert "packed fp32 GEMV for <= 64 rows: off (no AVX512 in this build)" in avx2.stderr, avx2.stderr[-2000:]


def _generate(folder, *, gemv_on: bool, monkeypatch, dtype: str = "bfloat16") -> list:
    monkeypatch.setenv("TAPLLM_PACKED_GEMV", "1" if gemv_on else "0")
    monkeypatch.setattr(gemv, "_state", {})
    llm = LLM(folder, dtype=dtype)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    on = [m.gemv is not None for m in linears]
    # on: every linear whose packing the kernel reads (oneDNN may lay some shapes out otherwise), at least one
    assert linears and (any(on) if gemv_on else not any(on))
    spec = HiddenStatesSpec(layers="all", points=["resid_post", "attn_out"], positions="all")
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, hidden_states=spec),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    return llm.generate(random_prompts([12, 3, 25, 8], seed=4), params * 2, use_tqdm=False)


@needs_gemv
def test_fused_step_with_the_gemv_tracks_the_step_without_it(tiny_models, monkeypatch):
    """Batches of 1-4 decodes take the GEMV, prefills oneDNN; states agree to bf16 rounding."""
    on = _generate(tiny_models["llama"], gemv_on=True, monkeypatch=monkeypatch)
    off = _generate(tiny_models["llama"], gemv_on=False, monkeypatch=monkeypatch)
    compared = 0
    for a, b in zip(on, off):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(ta) == len(tb)
        if b.hidden_states is None:
            continue
        # bf16 roundings may part greedy tokens; states agree up to the first parted token
        common = next((i for i, (u, v) in enumerate(zip(ta, tb)) if u != v), len(ta))
        rows = len(a.prompt_token_ids) + min(common, len(ta) - 1)
        compared += rows - len(a.prompt_token_ids)
        for point in ("resid_post", "attn_out"):
            x, y = a.hidden_states[point][:rows].float(), b.hidden_states[point][:rows].float()
            assert ((x - y).norm() / y.norm()).item() < 2e-2, point
    assert compared > 0  # some generated positions (the GEMV's decode steps) were compared


@pytest.mark.skipif(gemv_f32 is None, reason="no AVX512 packed float32 GEMV on this CPU")
def test_float32_fused_step_with_the_gemv_equals_the_step_without_it(tiny_models, monkeypatch):
    """float32: the same greedy tokens and states within summation order (1e-4), decodes and short prefills."""
    on = _generate(tiny_models["llama"], gemv_on=True, monkeypatch=monkeypatch, dtype="float32")
    off = _generate(tiny_models["llama"], gemv_on=False, monkeypatch=monkeypatch, dtype="float32")
    for a, b in zip(on, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if b.hidden_states is not None:
            for point in ("resid_post", "attn_out"):
                torch.testing.assert_close(a.hidden_states[point], b.hidden_states[point], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(gemv_f32 is None, reason="no AVX512 packed float32 GEMV on this CPU")
def test_a_layout_the_kernel_does_not_read_keeps_onednn_for_that_layer():
    # oneDNN packs a float32 weight of one output plainly (256 bytes, no 64-output block)
    lin = Linear(64, 1, bias=False, dtype=torch.float32)
    lin.weight.data = torch.randn(1, 64)
    lin.pack()
    with pytest.raises(RuntimeError, match="blocked layout"):
        gemv_f32.packed_view(lin.packed)
    lin.use_gemv(gemv_f32, gemv.MAX_ROWS)
    assert lin.gemv is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [None], ""))
