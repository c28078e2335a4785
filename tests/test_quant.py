"""Weights kept quantized (int8 per channel, int4 per group): the kernel against its reference,
and whole models against a float checkpoint holding the dequantized weights of the same
quantization (linears, LM head and embedding table) — greedy tokens equal, states at every
block and at the embedding within float32 summation error, with capture, steering and the lens
on; results and the server name the quantization; the embedding keeps no float copy.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.config import EngineConfig
from tapllm.kernels import fused_kernels
from tapllm.quant import parse_quantization
from tapllm.quant.pack import (dequantize, fit_group, pack_nibbles, quantize_int4, quantize_int8, quantize_q4_k,
                               unpack_nibbles)

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_quantization_options_are_validated():
    assert parse_quantization(None) is None
    assert parse_quantization("int4").describe() == "int4-g128"
    assert parse_quantization("int4", 32).describe() == "int4-g32"
    assert parse_quantization("int8").describe() == "int8"
    assert parse_quantization("q4_k", None, True).describe() == "q4_k+a8"
    with pytest.raises(ValueError, match="quantization_group_size applies to quantization='int4' only"):
        parse_quantization("q4_k", 32)
    with pytest.raises(ValueError, match="quantization must be one of"):
        parse_quantization("fp4")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        parse_quantization("int4", 48)
    with pytest.raises(ValueError, match="applies to quantization='int4' only"):
        parse_quantization("int8", 64)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4").validate()


def test_cli_flags_reach_the_engine_config():
    from tapllm.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "-q", "int4", "--quantization-group-size", "32"])
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.quantization, cfg.quantization_group_size) == ("int4", 32)
    assert cfg.quant().describe() == "int4-g32"


def test_packing_round_trips():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    assert fit_group(128, 576) == 64 and fit_group(32, 48) is None
    w = torch.randn(7, 96)
    for blocks, step in ((quantize_int4(w, 32), 15), (quantize_int8(w), 254), (quantize_int8(w, 32), 254)):
        deq = dequantize(blocks, 96)
        spread = w.view(7, blocks.shape[1], -1)
        spread = (spread.amax(-1) - spread.amin(-1)) if step == 15 else 2 * spread.abs().amax(-1)
        assert ((deq - w).view_as(spread[..., None].expand(-1, -1, 96 // blocks.shape[1])).abs()
                <= (spread / step * 0.51 + 1e-3)[..., None]).all()
    assert tuple(quantize_int4(w, 32).shape) == (7, 3, 20)  # GGUF Q4_1's 20-byte blocks
    assert tuple(quantize_int8(w, 32).shape) == (7, 3, 34)  # GGUF Q8_0's 34-byte blocks
    const = torch.full((2, 32), 0.25)  # a constant group has d = 0 and keeps its value exactly
    assert torch.equal(dequantize(quantize_int4(const, 32), 32), const)


def _q4_0(w: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 blocks of ``w`` (via the gguf package), as ``uint8 [N, K/32, 18]``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(w.numpy(), GGMLQuantizationType.Q4_0)
    return torch.from_numpy(raw.copy()).view(w.shape[0], -1, 18)


def k_quant_blocks(n: int, k: int, kind: str, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random GGUF ``Q4_K`` / ``Q6_K`` super-blocks ``uint8 [n, k/256, B]`` (every bit pattern of
    their integers and 6-/8-bit scales is valid; the float16 ``d`` / ``dmin`` are drawn finite,
    ``scale`` times a size giving weights of order 0.1-1). The gguf package cannot quantize to them."""
    nbytes = 144 if kind == "q4_k" else 210
    blocks = torch.randint(0, 256, (n, k // 256, nbytes), generator=g, dtype=torch.uint8)

    def halves(size: float) -> torch.Tensor:
        d = (torch.rand(n, k // 256, generator=g) * 0.75 + 0.25) * size * scale
        return d.half().view(torch.uint8).view(n, k // 256, 2)

    if kind == "q4_k":
        blocks[..., 0:2], blocks[..., 2:4] = halves(2e-3), halves(4e-3)
    else:
        blocks[..., 208:210] = halves(4e-4)
    return blocks


KINDS = ["int4-32", "int4-64", "int8", "int8-32", "q4_0", "q4_k", "q6_k"]
GGUF_TYPES = {"q4_0": "Q4_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}


def kernel_case(kind: str, seed: int) -> tuple:
    """``(ops, generator, n, k, w, blocks)`` for a kernel test of block layout ``kind``: 45 columns
    leave a remainder after every tile width (K-quants: random blocks, ``w`` what they stand for).
    Skips where the fused kernels do not run."""
    ops = fused_kernels()
    if ops is None:
        pytest.skip("no fused kernels on this machine")
    g = torch.Generator().manual_seed(seed)
    n, k = 45, 512 if kind in ("q4_k", "q6_k") else 192
    if kind in ("q4_k", "q6_k"):
        blocks = k_quant_blocks(n, k, kind, g)
        return ops, g, n, k, dequantize(blocks, k), blocks
    w = torch.randn(n, k, generator=g)
    blocks = {"int4-32": lambda: quantize_int4(w, 32), "int4-64": lambda: quantize_int4(w, 64),
              "int8": lambda: quantize_int8(w), "int8-32": lambda: quantize_int8(w, 32), "q4_0": lambda: _q4_0(w)}[kind]()
    return ops, g, n, k, w, blocks


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_reference(kind):
    ops, g, n, k, w, blocks = kernel_case(kind, 0)
    deq = dequantize(blocks, k)
    assert ((deq - w).norm() / w.norm()) < (0.02 if kind.startswith("int8") else 0.15)
    if kind in GGUF_TYPES:  # the gguf package's own dequantization agrees with ours
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        ref = gguf_dequantize(blocks.view(n, -1).numpy(), GGMLQuantizationType[GGUF_TYPES[kind]])
        torch.testing.assert_close(deq, torch.from_numpy(ref.reshape(n, k)), rtol=1e-6, atol=1e-6)
    # equal but for the rounding of d * q + m (one fused multiply-add in C++)
    torch.testing.assert_close(ops.quant_dequantize(blocks, k, torch.float32), deq, rtol=1e-6, atol=1e-6)
    for m in (1, 2, 3, 7, 16, 17, 40):  # every row tile, and the dequantize-then-GEMM path
        for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1.5e-2)):
            x, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            got = ops.quant_linear(x, blocks, b)
            want = F.linear(x.float(), deq, b.float())
            assert got.dtype == dtype and got.shape == (m, n)
            assert ((got.float() - want).abs().max() / want.abs().max()) < tol, (m, dtype)


def _dequantized_checkpoint(src, dst, method: str, group: int | None, embedding: bool = True):
    """A float32 copy of checkpoint ``src`` whose linear weights, LM head (tied or not) and, with
    ``embedding``, embedding table are the dequantized weights that ``quantization=method`` computes with."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        cfg["tie_word_embeddings"] = False
        (dst / "config.json").write_text(json.dumps(cfg))
    for name, t in tensors.items():
        if (name == "lm_head.weight" or any(f"{p}.weight" in name for p in PROJ)
                or (embedding and name == "model.embed_tokens.weight")):
            k = t.shape[1]
            if method == "q4_k":  # Q4_K super-blocks where the inputs allow, else int4 groups of 32
                blocks = quantize_q4_k(t) if k % 256 == 0 else quantize_int4(t, 32)
            else:
                blocks = quantize_int4(t, fit_group(group, k)) if method == "int4" else quantize_int8(t)
            tensors[name] = dequantize(blocks, k).contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


SPEC = HiddenStatesSpec(points=["embed", "resid_post", "final"], layers="all", positions="all", lens=3)


def _assert_embedding_packed(model) -> None:
    """The embedding is packed blocks only (no float table), and a tied head shares them."""
    from tapllm.quant.embedding import QuantEmbedding

    emb = model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and not hasattr(emb, "weight")
    assert list(emb.parameters()) == []
    assert [(n, b.dtype) for n, b in emb.named_buffers()] == [("blocks", torch.uint8)]
    assert emb.blocks.shape[0] == model.cfg.vocab_size
    if model.tied:
        assert model.lm_head.blocks.data_ptr() == emb.blocks.data_ptr()
    floats = [n for n, p in model.named_parameters() if p.shape[0] == model.cfg.vocab_size]
    assert floats == [], floats  # no vocab-sized float tensor anywhere (embedding or head)


@pytest.mark.parametrize("name,method,group", [("llama", "int4", 32), ("llama3-rope-tied", "int8", None),
                                               ("qwen2", "int4", 64), ("llama", "int8", None),
                                               ("qwen3", "int4", 32)])
def test_quantized_model_equals_its_dequantized_reference(tiny_models, tmp_path, name, method, group):
    src = tiny_models[name]
    ref_folder = _dequantized_checkpoint(src, tmp_path / "ref", method, group or 128)
    prompts = random_prompts([9, 21], seed=5)
    steer = [Steer(layers=[1], point="resid_post", vector=torch.randn(64, generator=torch.Generator().manual_seed(1)),
                   scale=2.0)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, hidden_states=SPEC, steering=steer)
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = LLM(ref_folder, dtype="float32", block_size=4)
    want, want_plain = ref.generate(prompts, params, use_tqdm=False), ref.generate(prompts, plain, use_tqdm=False)
    del ref
    for eager in (False, True):
        llm = LLM(src, dtype="float32", block_size=4, quantization=method, quantization_group_size=group,
                  enforce_eager=eager)
        _assert_embedding_packed(llm.engine.runner.model)
        got = llm.generate(prompts, params, use_tqdm=False)
        got_plain = llm.generate(prompts, plain, use_tqdm=False)  # no taps: the decode steps' fastest path
        for a, b in zip(got + got_plain, want + want_plain, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(got, want, strict=True):
            hs, rs = a.hidden_states, b.hidden_states
            assert hs.metadata["quantization"] == llm.engine.quantization == (f"int4-g{group}" if method == "int4"
                                                                               else "int8")
            for point in ("embed", "resid_post", "final"):
                torch.testing.assert_close(hs[point], rs[point], rtol=1e-4, atol=1e-4)
            assert torch.equal(hs.lens["final"].token_ids, rs.lens["final"].token_ids)
        del llm


def test_quantized_states_save_and_wire_name_the_quantization(tiny_models, tmp_path):
    from tapllm.hidden_states.json_codec import hidden_states_from_wire, hidden_states_to_wire
    from tapllm.hidden_states.result import HiddenStates

    llm = LLM(tiny_models["llama"], dtype="float32", block_size=4, quantization="int8")
    out = llm.encode([random_prompts([6])[0]], HiddenStatesSpec(points="resid_post", layers=[0]))[0]
    hs = out.hidden_states
    assert hs.metadata == {"quantization": "int8"}
    assert HiddenStates.load(hs.save(tmp_path / "s.safetensors")).metadata["quantization"] == "int8"
    assert hidden_states_from_wire(hidden_states_to_wire(hs)).metadata["quantization"] == "int8"
    from tapllm.quant.linear import QuantLinear

    model = llm.engine.runner.model
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * len(model.layers) + 1
    assert (model.stack is not None) == (fused_kernels() is not None)  # decode steps run in C++ too
    _assert_embedding_packed(model)


def test_embedding_opt_out_keeps_the_float_table(tiny_models, tmp_path):
    """``quantize_embedding=False``: the table stays in ``dtype`` (the ``embed`` point is exact), the
    tied head is still quantized from it; the states equal a reference with only the head dequantized."""
    src = tiny_models["llama3-rope-tied"]
    ref_folder = _dequantized_checkpoint(src, tmp_path / "ref", "int8", None, embedding=False)
    prompts = random_prompts([9, 14], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, hidden_states=SPEC)
    want = LLM(ref_folder, dtype="float32", block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(src, dtype="float32", block_size=4, quantization="int8", quantize_embedding=False)
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, torch.nn.Embedding) and model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.blocks.data_ptr() != model.embed_tokens.weight.data_ptr()
    for a, b in zip(llm.generate(prompts, params, use_tqdm=False), want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for point in ("embed", "resid_post", "final"):
            torch.testing.assert_close(a.hidden_states[point], b.hidden_states[point], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="quantize_embedding must be True or False"):
        EngineConfig(quantize_embedding="no").validate()
    from tapllm.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "-q", "int8", "--no-quantize-embedding"])
    assert EngineConfig.from_cli_args(args).quantize_embedding is False


@pytest.mark.parametrize("embed_type,tied", [(None, False), ("Q4_0", False), ("Q4_1", True)])
def test_gguf_blocks_run_as_stored(tiny_models, tmp_path, embed_type, tied):
    """A Llama GGUF with Q4_0, Q4_1 and Q8_0 tensors: ``quantization="gguf"`` keeps their blocks
    (a fused q/k/v of mixed types stays dequantized) and a kept-type ``token_embd`` as the
    embedding's blocks (shared with a tied head), and equals the dequantized GGUF."""
    from gguf_writer import llama_gguf
    from tapllm.quant.linear import QuantLinear

    kinds = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
    types = {"output.weight": "Q8_0", "blk.0.attn_v.weight": "Q8_0"}  # block 0's q/k/v mix types: not kept
    if embed_type is not None:
        types["token_embd.weight"] = embed_type
    path = llama_gguf(tiny_models["llama"], tmp_path / "tiny-q.gguf", kinds, types, tied)
    prompts = random_prompts([7, 18], seed=9)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, hidden_states=SPEC)
    want = LLM(path, dtype="float32", block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, dtype="float32", block_size=4, quantization="gguf")
    model = llm.engine.runner.model
    assert not isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert tuple(model.layers[1].self_attn.qkv_proj.blocks.shape[1:]) == (2, 18)  # Q4_0
    assert tuple(model.layers[1].mlp.gate_up_proj.blocks.shape[1:]) == (2, 20)  # Q4_1
    embed_shape = {None: None, "Q4_0": (2, 18), "Q4_1": (2, 20)}[embed_type]
    assert tuple(model.lm_head.blocks.shape[1:]) == (embed_shape if tied else (2, 34))  # Q8_0 output
    if embed_type is None:
        assert isinstance(model.embed_tokens, torch.nn.Embedding)  # F32 in the file: float as before
    else:
        _assert_embedding_packed(model)
        assert tuple(model.embed_tokens.blocks.shape[1:]) == embed_shape
    got = llm.generate(prompts, params, use_tqdm=False)
    del llm
    runs = [got]
    if tied:  # opting out keeps the table in float; the tied head still reads the file's blocks
        llm = LLM(path, dtype="float32", block_size=4, quantization="gguf", quantize_embedding=False)
        model = llm.engine.runner.model
        assert isinstance(model.embed_tokens, torch.nn.Embedding)
        assert tuple(model.lm_head.blocks.shape[1:]) == embed_shape
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    for run in runs:
        for a, b in zip(run, want, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.hidden_states.metadata["quantization"] == "gguf"
            for point in ("embed", "resid_post", "final"):
                torch.testing.assert_close(a.hidden_states[point], b.hidden_states[point], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        LLM(tiny_models["llama"], dtype="float32", quantization="gguf")


def test_gguf_k_quants_run_as_stored(tmp_path):
    """A Llama GGUF laid out like llama.cpp's Q4_K_M (Q4_K for most tensors and the embedding,
    Q6_K for ffn_down, the output and one block's attn_v): ``quantization="gguf"`` keeps every
    K-quant tensor in its super-blocks (the fused q/k/v of mixed types as one part per type, that
    block outside the C++ runner) and equals the model the gguf package dequantizes, tokens and
    states."""
    from gguf_writer import write_gguf
    from tapllm.quant.embedding import QuantEmbedding
    from tapllm.quant.linear import SplitQuantLinear

    g = torch.Generator().manual_seed(5)
    hidden, inter, heads, kv_heads, vocab, layers = 256, 512, 4, 2, 49152, 2
    head_dim = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    tensors: dict[str, torch.Tensor] = {"output_norm.weight": torch.ones(hidden)}
    types: dict[str, str] = {}

    def put(name: str, n: int, k: int, kind: str) -> None:
        tensors[name] = k_quant_blocks(n, k, kind, g, scale=0.1).view(n, -1)
        types[name] = GGUF_TYPES[kind]

    put("token_embd.weight", vocab, hidden, "q4_k")
    put("output.weight", vocab, hidden, "q6_k")
    for i in range(layers):
        tensors[f"blk.{i}.attn_norm.weight"] = torch.ones(hidden)
        tensors[f"blk.{i}.ffn_norm.weight"] = torch.ones(hidden)
        for part, (n, k) in shapes.items():
            kind = "q6_k" if part == "ffn_down" or (i == 0 and part == "attn_v") else "q4_k"
            put(f"blk.{i}.{part}.weight", n, k, kind)
    kv = {"block_count": layers, "context_length": 512, "embedding_length": hidden, "feed_forward_length": inter,
          "attention.head_count": heads, "attention.head_count_kv": kv_heads, "rope.freq_base": 10000.0,
          "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": vocab, "rope.dimension_count": head_dim}
    path = write_gguf(tmp_path / "tiny-q4_k_m.gguf", "llama", kv, tensors, types)
    prompts = random_prompts([9, 21], seed=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, hidden_states=SPEC)
    want = LLM(path, dtype="float32", block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, dtype="float32", block_size=4, quantization="gguf")
    model = llm.engine.runner.model
    split = model.layers[0].self_attn.qkv_proj  # Q4_K q and k, a Q6_K v
    assert isinstance(split, SplitQuantLinear) and split.starts == [0, hidden, hidden + kv_heads * head_dim]
    assert [tuple(p.blocks.shape[1:]) for p in split.parts] == [(1, 144), (1, 144), (1, 210)]
    assert tuple(model.layers[1].self_attn.qkv_proj.blocks.shape[1:]) == (1, 144)
    if model.stack is not None:  # the fused kernels run: block 0 in Python, block 1 in the C++ runner
        assert model.stack.runs == [False, True]
    assert tuple(model.layers[0].mlp.down_proj.blocks.shape[1:]) == (2, 210)
    assert tuple(model.lm_head.blocks.shape[1:]) == (1, 210)
    assert isinstance(model.embed_tokens, QuantEmbedding) and tuple(model.embed_tokens.blocks.shape[1:]) == (1, 144)
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for point in ("embed", "resid_post", "final"):
            torch.testing.assert_close(a.hidden_states[point], b.hidden_states[point], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="come from a GGUF file"):
        model.lm_head.load_rows(None, torch.zeros(vocab, hidden))


def test_split_quant_linear_parts_and_bias():
    """A fused weight of parts in different layouts: each part in its own blocks, the output the
    concatenation plus the fused bias; rows that would span two parts are refused."""
    from tapllm.quant.linear import SplitQuantLinear
    from tapllm.quant.schemes import Quantization

    g = torch.Generator().manual_seed(2)
    k = 256
    parts = [k_quant_blocks(8, k, "q4_k", g), k_quant_blocks(4, k, "q6_k", g),
             quantize_int8(torch.randn(4, k, generator=g), 32)]
    layer = SplitQuantLinear(k, [(p.shape[0], tuple(p.shape[1:])) for p in parts], True, torch.float32,
                             Quantization("gguf"))
    offset = 0
    for p in parts:
        layer.load_rows(offset, p)
        offset += p.shape[0]
    layer.bias.data.copy_(torch.randn(16, generator=g))
    deq = torch.cat([dequantize(p, k) for p in parts])
    torch.testing.assert_close(layer.dequantized(), deq)
    x = torch.randn(3, k, generator=g)
    for ops in (None, fused_kernels()):
        for part in layer.parts:
            part.ops = ops
        torch.testing.assert_close(layer(x), F.linear(x, deq, layer.bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="span parts"):
        layer.load_rows(6, parts[1])


@pytest.mark.parametrize("a8", [False, True])
def test_q4_k_quantized_at_load(default_model_folder, tmp_path, a8):
    """``quantization="q4_k"`` packs a float checkpoint into GGUF's Q4_K super-blocks at load (the
    embedding and a tied head too; any input size not a multiple of 256 falls back to int4 groups
    of 32): tokens and states equal the dequantized checkpoint's, fused and eager; with
    ``quantize_activations`` the fused and eager steps agree."""
    from conftest import save_tiny_model
    from transformers import LlamaConfig

    from tapllm.quant.linear import QuantLinear

    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.05, rms_norm_eps=1e-6, tie_word_embeddings=True)
    src = save_tiny_model(tmp_path / "src", cfg, default_model_folder)
    prompts = random_prompts([9, 21], seed=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, hidden_states=SPEC)
    if not a8:
        ref = LLM(_dequantized_checkpoint(src, tmp_path / "ref", "q4_k", None), dtype="float32", block_size=4)
        want = ref.generate(prompts, params, use_tqdm=False)
        del ref
    runs = []
    for eager in (False, True):
        llm = LLM(src, dtype="float32", block_size=4, quantization="q4_k", quantize_activations=a8,
                  enforce_eager=eager)
        model = llm.engine.runner.model
        assert llm.engine.quantization == ("q4_k+a8" if a8 else "q4_k")
        assert tuple(model.layers[0].mlp.gate_up_proj.blocks.shape[1:]) == (1, 144)
        assert tuple(model.layers[0].mlp.down_proj.blocks.shape[1:]) == (20, 20)  # 640 inputs: int4 g32
        assert tuple(model.embed_tokens.blocks.shape[1:]) == (1, 144)
        assert isinstance(model.lm_head, QuantLinear)
        assert model.lm_head.blocks.data_ptr() == model.embed_tokens.blocks.data_ptr()
        # with the rounding, a value at a rounding boundary may round apart on the two paths (float
        # sums in another order): compare the prompts' states, which no diverging token can move
        runs.append(llm.encode(prompts, SPEC, use_tqdm=False) if a8 else llm.generate(prompts, params, use_tqdm=False))
        del llm
    for a, b in zip(runs[1], runs[0] if a8 else want, strict=True):
        if not a8:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for point in ("embed", "resid_post", "final"):
            tol = 5e-2 if a8 else 1e-4
            torch.testing.assert_close(a.hidden_states[point], b.hidden_states[point], rtol=tol, atol=tol)
    if not a8:
        for a, b in zip(runs[0], want, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for point in ("embed", "resid_post", "final"):
                torch.testing.assert_close(a.hidden_states[point], b.hidden_states[point], rtol=1e-4, atol=1e-4)
