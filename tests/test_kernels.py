"""tapllm's fused C++ kernels against their plain-PyTorch definitions, and the probe around them.

Every op is checked on random shapes in float32 and bfloat16 (GQA groups, head sizes that do
and don't fill a vector, sliding windows, soft-caps, scattered block tables, strided views as
the model passes them). The emulated AVX2 CPU (``ATEN_CPU_CAPABILITY=avx2``) loads the AVX2
build of the same source, which must agree too; a missing compiler or ``TAPLLM_KERNELS=0``
leaves the eager path with the reason logged.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tapllm.kernels import fused_kernels, reference

ops = fused_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler here: the kernels cannot be built")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _close_in_dtype(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 64), (33, 100), (3, 2048)])
def test_norms(dtype, rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    for mode in (reference.RMS_LLAMA, reference.RMS_FLOAT_SCALE, reference.RMS_GEMMA):
        _close_in_dtype(ops.rms_norm(x, w, 1e-6, mode), reference.rms_norm(x, w, 1e-6, mode), dtype)
    r = torch.randn(rows, width, generator=g).to(dtype)
    x2 = x.clone()
    normed = ops.add_rms_norm_(x2, r, w, 1e-6, reference.RMS_LLAMA)
    assert torch.equal(x2, x + r)  # the residual add is exact, as the eager add
    _close_in_dtype(normed, reference.rms_norm(x + r, w, 1e-6, reference.RMS_LLAMA), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 37), (64, 256)])
def test_gated_activations(dtype, rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    for mode in (reference.ACT_SILU, reference.ACT_GELU_TANH):
        _close_in_dtype(ops.gated_act(gate_up, mode), reference.gated_act(gate_up, mode), dtype)
    strided = torch.randn(rows, 2 * inter + 8, generator=g).to(dtype)[:, : 2 * inter]  # rows with a gap
    _close_in_dtype(ops.gated_act(strided, 0), reference.gated_act(strided, 0), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim,rdim", [(9, 3, 64, 64), (4, 4, 96, 32), (8, 2, 128, 128), (2, 1, 80, 80)])
def test_rotary_on_views_of_the_fused_projection(dtype, heads, kv_heads, dim, rdim):
    g = torch.Generator().manual_seed(dim + rdim)
    t = 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    angles = torch.rand(t, rdim // 2, generator=g) * 50
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    for c, s in ((cos.to(dtype), sin.to(dtype)), (cos, sin)):  # cast like Llama's tables, and float32 (OLMo-2)
        want_q, want_k = reference.rotary(q, k, c, s)
        q2, k2 = q.clone(), k.clone()
        ops.rotary_(q2, k2, c, s)
        _close_in_dtype(q2, want_q, dtype)
        _close_in_dtype(k2, want_k, dtype)


def _cache(dtype: torch.dtype, kv_heads: int, blocks: int, bs: int, dim: int, g: torch.Generator):
    return (torch.randn(kv_heads, blocks, bs, dim, generator=g).to(dtype),
            torch.randn(kv_heads, blocks, bs, dim, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 80), (8, 1, 128), (2, 2, 256), (6, 3, 40)])
def test_decode_attention_reads_scattered_blocks(dtype, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(heads * dim)
    bs, blocks = 4, 40
    k_cache, v_cache = _cache(dtype, kv_heads, blocks, bs, dim, g)
    lens = torch.tensor([1, 7, 16, 29])
    tables = torch.randperm(blocks, generator=g)[:32].view(4, 8)  # each sequence's blocks anywhere
    q_rows = torch.randn(4, heads * dim + 16, generator=g).to(dtype)  # q as a strided view, as the model passes it
    q = q_rows[:, : heads * dim].view(4, heads, dim)
    for window, softcap in ((0, 0.0), (5, 0.0), (0, 30.0), (3, 2.0), (100, 0.0)):
        got = ops.decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, window, softcap)
        want = reference.decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, window, softcap)
        _close_in_dtype(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
def test_decode_attention_over_long_scattered_contexts(dtype, heads, kv_heads, dim):
    # contexts of many 16-key chunks and odd lengths: the bf16 dot-product path's key pairs and prefetches
    g = torch.Generator().manual_seed(dim)
    bs, blocks = 16, 80
    k_cache, v_cache = _cache(dtype, kv_heads, blocks, bs, dim, g)
    lens = torch.tensor([37, 100, 161, 255, 256])
    tables = torch.randperm(blocks, generator=g)[:80].view(5, 16)
    q = torch.randn(5, heads, dim, generator=g).to(dtype)
    for window, softcap in ((0, 0.0), (77, 0.0), (0, 20.0)):
        got = ops.decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, window, softcap)
        want = reference.decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, window, softcap)
        _close_in_dtype(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_scatters_rows_and_zeroes_non_finite_values(dtype):
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.zeros(2, 10, 4, 8, dtype=dtype), torch.zeros(2, 10, 4, 8, dtype=dtype)
    kv = torch.randn(5, 4 * 8 + 3, generator=g).to(dtype)
    k, v = kv[:, :16].view(5, 2, 8), kv[:, 16:32].view(5, 2, 8)
    v[1, 0, 3], v[2, 1, 0], v[4, 1, 7] = float("nan"), float("inf"), float("-inf")
    slots = torch.tensor([39, 0, 17, 5, 22])
    ops.kv_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(2, 40, 8)[:, slots], k.transpose(0, 1))
    want_v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    assert torch.equal(v_cache.view(2, 40, 8)[:, slots], want_v.transpose(0, 1))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(2, 40, 8)[:, untouched].any()


def test_bfloat16_denormals_and_nan_round_as_the_eager_step():
    """AVX512-BF16's conversion flushes denormals and keeps NaN payloads; rows holding either must
    come out bit for bit as the eager step's (the integer rounding), HW conversion or not."""
    bf = torch.bfloat16
    tiny = torch.tensor([1e-39, -3e-39, 5e-40, 1e-40] * 16).to(bf)  # bfloat16 denormals
    gate_up = torch.cat((tiny.repeat(3, 1), torch.ones(3, 64, dtype=bf)), 1)
    gate_up[1, 5] = float("nan")
    got, want = ops.gated_act(gate_up, reference.ACT_SILU), reference.gated_act(gate_up, reference.ACT_SILU)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert (got.float().abs() < 1.2e-38).logical_and(got != 0).any()  # denormals kept, not flushed
    q, k = tiny.view(1, 1, 64).repeat(2, 3, 1), tiny.view(1, 1, 64).repeat(2, 1, 1)
    cos, sin = torch.ones(2, 64, dtype=bf), torch.zeros(2, 64, dtype=bf)
    want_q, want_k = reference.rotary(q, k, cos, sin)
    ops.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and bool(q.ne(0).any())
    x, w = torch.full((2, 64), 1e-3, dtype=bf), tiny
    assert torch.equal(ops.rms_norm(x, w, 1e-6, reference.RMS_FLOAT_SCALE), reference.rms_norm(x, w, 1e-6, 1))


def test_avx512_without_bf16_conversion_instructions_passes_the_same_checks():
    proc = _check_all_in_a_fresh_process(TAPLLM_NO_AVX512BF16="1")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    k_cache = torch.zeros(2, 4, 4, 8)
    with pytest.raises(RuntimeError, match="heads"):
        ops.decode_attention(torch.zeros(1, 3, 8), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.long),
                             torch.tensor([3]), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="int64"):
        ops.decode_attention(torch.zeros(1, 4, 8), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.int32),
                             torch.tensor([3]), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="block table is too short"):  # 9 keys need 3 blocks of 4
        ops.decode_attention(torch.zeros(1, 4, 8), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.long),
                             torch.tensor([9]), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="names block 4 of a cache of 4"):
        ops.decode_attention(torch.zeros(1, 4, 8), k_cache, k_cache, torch.tensor([[0, 4]]),
                             torch.tensor([5]), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6, 0)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def _check_all_in_a_fresh_process(**env: str) -> subprocess.CompletedProcess:
    """Build/load the kernels under ``env`` and run every probe check; prints the variant and status."""
    code = ("from tapllm.kernels import fused_kernels, kernels_status, variant\n"
            "from tapllm.kernels.reference import check_all\n"
            "ops = fused_kernels(); print(variant(), kernels_status()); assert ops is not None, kernels_status()\n"
            "assert check_all(ops) is None\n")
    return _python(code, **env)


def test_emulated_avx2_cpu_builds_and_passes_the_same_checks():
    proc = _check_all_in_a_fresh_process(ATEN_CPU_CAPABILITY="avx2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("avx2 avx2"), proc.stdout


def test_without_a_compiler_or_when_turned_off_the_eager_step_runs():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from tapllm.kernels import fused_kernels\nassert fused_kernels() is None\n")
    off = _python(code, TAPLLM_KERNELS="0")
    assert off.returncode == 0 and "TAPLLM_KERNELS=0" in off.stderr, off.stderr[-2000:]
    broken = _python(code, CXX="/bin/false", PATH="/nonexistent", TAPLLM_KERNEL_CACHE=os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"tapllm-nocxx-{os.getpid()}"))
    assert broken.returncode == 0 and "fused CPU kernels off" in broken.stderr, broken.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 80), (8, 2, 128), (6, 3, 40)])
def test_prefill_attention_of_chunks_with_cached_context(dtype, heads, kv_heads, dim):
    """Chunks of 1-150 tokens after 0-90 cached ones (several key tiles and query blocks), scattered blocks,
    windows down to 1 token (rows that see no key of a tile), soft-caps; other rows stay zero."""
    g = torch.Generator().manual_seed(heads + dim)
    bs, blocks = 16, 64
    k_cache, v_cache = _cache(dtype, kv_heads, blocks, bs, dim, g)
    lens = torch.tensor([5, 150, 1, 70, 33])
    contexts = torch.tensor([0, 0, 90, 17, 64])
    starts = torch.tensor([2, 7, 157, 158, 228])  # rows 0-1 are not part of any chunk
    tables = torch.randperm(blocks, generator=g)[:60].view(5, 12)
    q_rows = torch.randn(261, heads * dim + 8, generator=g).to(dtype)
    q = q_rows[:, : heads * dim].view(261, heads, dim)
    for window, softcap in ((0, 0.0), (1, 0.0), (7, 0.0), (100, 0.0), (0, 20.0), (9, 3.0)):
        got = ops.prefill_attention(q, k_cache, v_cache, starts, lens, contexts, tables, dim**-0.5, window, softcap)
        want = reference.prefill_attention(q, k_cache, v_cache, starts, lens, contexts, tables, dim**-0.5, window,
                                           softcap)
        _close_in_dtype(got, want, dtype)


def test_prefill_attention_refuses_a_block_table_too_short():
    k_cache = torch.zeros(1, 4, 4, 8)
    with pytest.raises(RuntimeError, match="block table"):
        ops.prefill_attention(torch.zeros(6, 1, 8), k_cache, k_cache, torch.tensor([0]), torch.tensor([6]),
                              torch.tensor([4]), torch.zeros(1, 2, dtype=torch.long), 1.0, 0, 0.0)
