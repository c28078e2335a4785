"""``quantize_activations``: the quantized linears' inputs rounded to int8 per run of 32 values
(llama.cpp's scheme). The rounding in C++ equals the Python definition bit for bit; the integer
kernel equals ``round_activations(x) @ dequant(W)^T`` up to float32 summation order at every row
count; whole models give the same tokens and states on the fused and the eager path, a request
alone equals it in a batch, and results name the scheme.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.config import EngineConfig
from tapllm.kernels import fused_kernels
from tapllm.quant import parse_quantization
from tapllm.quant.pack import dequantize, round_activations
from test_quant import KINDS, kernel_case


def test_option_is_validated_and_named():
    assert parse_quantization("int4", 64, True).describe() == "int4-g64+a8"
    assert parse_quantization("gguf", None, True).describe() == "gguf+a8"
    assert parse_quantization("int8").act_bits == 0 and parse_quantization("int8", None, True).act_bits == 8
    with pytest.raises(ValueError, match="quantize_activations needs a quantization"):
        EngineConfig(quantize_activations=True).validate()
    with pytest.raises(ValueError, match="quantize_activations must be True or False"):
        EngineConfig(quantization="int8", quantize_activations="yes").validate()
    from tapllm.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "-q", "int8", "--quantize-activations"])
    assert EngineConfig.from_cli_args(args).quant().describe() == "int8+a8"


def test_rounding_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g) * 4
    x[0, :32] = 0  # a zero run stays zero
    x[1, 40] = float("nan")  # a run with a NaN becomes NaN; its neighbours are untouched
    x[2, 70] = float("inf")
    r = round_activations(x)
    assert torch.equal(r[0, :32], torch.zeros(32))
    assert r[1, 32:64].isnan().all() and r[2, 64:].isnan().all()
    assert r[1, :32].isfinite().all() and r[2, :64].isfinite().all()
    finite = x.isfinite().view(3, 3, 32).all(-1, keepdim=True).expand(-1, -1, 32).reshape(3, 96)
    amax = x.view(3, 3, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(3, 96)
    err = (r - x).abs()[finite]
    assert (err <= amax[finite] / 254 * 1.0001).all()  # half a step of amax / 127
    nonzero = finite & (amax > 0)
    steps = (r / (amax / 127))[nonzero]
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)  # integers times the step
    ops = fused_kernels()
    if ops is not None:  # the kernel's rounding is the same, bit for bit (also for bf16 inputs)
        for t in (x, x.bfloat16(), torch.randn(5, 2, 64, generator=g)):
            torch.testing.assert_close(ops.round_activations(t), round_activations(t), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", KINDS)
def test_integer_kernel_matches_reference(kind):
    ops, g, n, k, _, blocks = kernel_case(kind, 1)
    deq = dequantize(blocks, k)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40):  # every row tile, and the GEMM path (4-bit kinds: 8 rows up)
        for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1.5e-2)):
            x, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            got = ops.quant_linear(x, blocks, b, 8)
            want = F.linear(round_activations(x), deq, b.float())
            assert got.dtype == dtype and got.shape == (m, n)
            assert ((got.float() - want).abs().max() / want.abs().max()) < tol, (m, dtype)
            if dtype == torch.float32:  # the rounding is what makes it differ from the float-input kernel
                plain = ops.quant_linear(x, blocks, b, 0)
                assert 1e-4 < ((got - plain).norm() / plain.norm()) < 3e-2
    with pytest.raises(RuntimeError, match="act_bits must be 0"):
        ops.quant_linear(torch.randn(1, k), blocks, None, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_integer_gemm_rows_equal_rows_alone(kind):
    """The row counts that take the integer GEMM (4-bit kinds, 8 rows and more; 45 columns leave
    a part-filled panel) give each row what it gets alone, up to float32 summation order; a row
    with a NaN or an infinity makes only its own outputs non-finite."""
    ops, g, n, k, _, blocks = kernel_case(kind, 2)
    x = torch.randn(23, k, generator=g)
    x[5, 3], x[11, k - 1] = float("nan"), float("inf")
    together = ops.quant_linear(x, blocks, None, 8)
    alone = torch.cat([ops.quant_linear(x[i:i + 1], blocks, None, 8) for i in range(x.shape[0])])
    bad = torch.zeros(x.shape[0], dtype=torch.bool)
    bad[[5, 11]] = True
    assert not together[bad].isfinite().any() and together[~bad].isfinite().all()
    rel = (together[~bad] - alone[~bad]).norm(dim=-1) / alone[~bad].norm(dim=-1)
    assert rel.max() < 1e-5, rel.max()


def _agree(runs: list, others: list) -> None:
    """Same math up to float32 summation order: most positions within 1e-5 of the norm, every one
    within 5e-2. A value near a rounding boundary may round one step the other way when the float
    sums before it are ordered differently (one step of amax / 127 in one input of one linear,
    ~3e-3 of a tiny model's state, carried on to later blocks and positions), and greedy tokens
    may then part; so at most one request's tokens may differ."""
    rels, same = [], 0
    for a, b in zip(runs, others, strict=True):
        same += a.outputs[0].token_ids == b.outputs[0].token_ids
        n = min(a.hidden_states["resid_post"].shape[0], b.hidden_states["resid_post"].shape[0])
        for point in ("embed", "resid_post", "final"):
            x, y = a.hidden_states[point][:n].float(), b.hidden_states[point][:n].float()
            rels.append(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-6)).flatten())
    rel = torch.cat(rels)
    assert same >= len(runs) - 1
    assert rel.median() <= 1e-5 and rel.max() <= 5e-2, (rel.max(), (rel > 1e-5).float().mean())


@pytest.mark.parametrize("name,method,group", [("llama", "int4", 32), ("qwen2", "int8", None)])
def test_models_agree_on_both_paths_and_in_any_batch(tiny_models, name, method, group):
    src = tiny_models[name]
    spec = HiddenStatesSpec(points=["embed", "resid_post", "final"], layers="all", positions="all")
    steer = [Steer(layers=[1], point="resid_post", vector=torch.randn(64, generator=torch.Generator().manual_seed(1)),
                   scale=2.0)]
    prompts = random_prompts([9, 21, 5, 30], seed=7)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, hidden_states=spec, steering=steer)
    runs = {}
    for eager in (True, False):
        llm = LLM(src, dtype="float32", block_size=4, quantization=method, quantization_group_size=group,
                  quantize_activations=True, enforce_eager=eager)
        runs[eager] = llm.generate(prompts, params, use_tqdm=False)
        if not eager:  # each request alone (one-row decode steps) against the batch
            alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            quant = llm.engine.quantization
        del llm
    label = (f"int4-g{group}" if method == "int4" else method) + "+a8"
    assert quant == label
    assert all(o.hidden_states.metadata["quantization"] == label for o in runs[False])
    _agree(runs[False], runs[True])
    _agree(runs[False], alone)
