"""Quantized weights split over ranks: TP 2, PP 2 and TP 2 x PP 2 give what one process gives with the
same quantization (int8 with its whole-row scales, int4, q4_k with activation rounding, a GGUF file's
blocks as stored), each rank holding its slice of the very blocks one process holds.

Greedy tokens identical, states within 1e-5 in float32 (the ranks' partial sums add in another order);
a split that would cut a block of a row-parallel layer's inputs is refused at start-up, naming the fields.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from helpers import greedy
from tapllm import LLM, HiddenStatesSpec, Steer
from tapllm.parallel import ShardLayout
from test_tensor_parallel import _same

ENGINE = dict(dtype="float32", kv_cache_blocks=96, max_num_batched_tokens=32)
POINTS = ["embed", "resid_mid", "resid_post", "attn_out", "mlp_out", "z", "mlp_post", "final"]
SPEC = HiddenStatesSpec(layers="all", points=POINTS, positions="all")


def _requests() -> tuple[list[list[int]], list]:
    prompts = random_prompts([5, 40, 11], seed=7)  # 40 > the budget of 32: chunked prefill
    steer = [Steer(layers=[1], point="resid_post", vector=torch.linspace(-1, 1, 64), scale=2.0),
             Steer(layers=[0], point="mlp_post", op="scale", scale=0.0, neurons=[3, 100])]
    return prompts, [greedy(6, hidden_states=SPEC), greedy(5, hidden_states=SPEC, steering=steer), greedy(4)]


def _compare(folder, quant: dict, split: dict) -> tuple[LLM, LLM]:
    one = LLM(folder, enforce_eager=True, **quant, **ENGINE)
    prompts, params = _requests()
    want = one.generate(prompts, params, use_tqdm=False)
    many = LLM(folder, **quant, **split, **ENGINE)
    # Rounding activations to int8 (quantize_activations) is a step function: inputs that differ in their
    # last bits (another order of the same sums: the ranks' partial sums, or another kernel in one process)
    # may round one value to the next step, ~1% of its run's scale. Tokens must still agree; states do not
    # agree to 1e-5, in one process (eager against kernels) as over ranks.
    points = None if quant.get("quantize_activations") else POINTS
    try:
        _same(want, many.generate(prompts, params, use_tqdm=False), points)
        return one, many
    except BaseException:
        many.close()
        raise


def _blocks(model) -> list[torch.Tensor]:
    return [m.blocks for m in model.modules() if hasattr(m, "blocks")]


@pytest.mark.parametrize("quant", [dict(quantization="int8"),
                                   dict(quantization="int4", quantization_group_size=32),
                                   dict(quantization="q4_k"), dict(quantization="q4_k", quantize_activations=True),
                                   dict(quantization="int8", quantize_embedding=False)],
                         ids=["int8", "int4-g32", "q4_k", "q4_k-a8", "int8-float-embedding"])
def test_tp2_quantized_equals_one_process(tiny_models, quant):
    one, tp = _compare(tiny_models["llama"], quant, dict(tensor_parallel_size=2))
    try:
        whole, rank0 = one.engine.runner.model, tp.engine.runner.tp.model
        o_one, o_tp = whole.layers[0].self_attn.o_proj, rank0.layers[0].self_attn.o_proj
        # rank 0's o_proj blocks are the first half of one process's blocks, bit for bit (int8: the whole
        # row's scale, then the first half of the row's integers)
        if quant["quantization"] == "int8":
            assert torch.equal(o_tp.blocks[..., :2], o_one.blocks[..., :2])
            assert torch.equal(o_tp.blocks[..., 2:], o_one.blocks[..., 2:2 + o_tp.in_features])
        else:
            assert torch.equal(o_tp.blocks, o_one.blocks[:, : o_one.blocks.shape[1] // 2])
        head = rank0.lm_head
        assert hasattr(head, "blocks") and head.blocks.shape[0] == one.engine.runner.model.cfg.vocab_size // 2
        # the head shares the table's blocks where one process's does (a tied model with the table quantized)
        shared = whole.lm_head.blocks is getattr(whole.embed_tokens, "blocks", None)
        assert (head.blocks is getattr(rank0.embed_tokens, "blocks", None)) == shared
        described = tp.describe()
        assert one.describe().split("linear layers: ")[1].split("\n")[0] in described
        # every rank holds half of the packed blocks (the vocabulary rows and MLP neurons split evenly here)
        per_rank = tp.engine.runner.tp.weight_bytes
        total = sum(b.numel() for b in {id(b): b for b in _blocks(whole)}.values())
        assert all(b < total * 0.6 + sum(p.numel() * 4 for p in whole.parameters()) for b in per_rank)
    finally:
        tp.close()


@pytest.mark.parametrize("table", [True, False], ids=["quantized-table", "float-table"])
def test_tied_head_quantized_as_one_process(tiny_models, table):
    """A tied model: the head shares the quantized table's blocks, or (``quantize_embedding=False``) is quantized
    from the float table once it is loaded, on every rank its vocabulary rows."""
    quant = dict(quantization="int8", quantize_embedding=table)
    one, tp = _compare(tiny_models["llama3-rope-tied"], quant, dict(tensor_parallel_size=2))
    try:
        rank0 = tp.engine.runner.tp.model
        assert type(rank0.lm_head).__name__ == "QuantGatheredHead"
        assert (rank0.lm_head.blocks is getattr(rank0.embed_tokens, "blocks", None)) == table
        whole = one.engine.runner.model
        assert torch.equal(rank0.lm_head.blocks, whole.lm_head.blocks[: rank0.lm_head.blocks.shape[0]])
    finally:
        tp.close()


@pytest.mark.parametrize("split", [dict(pipeline_parallel_size=2),
                                   dict(pipeline_parallel_size=2, tensor_parallel_size=2)], ids=["pp2", "tp2pp2"])
def test_pipeline_stages_quantized_equal_one_process(tiny_models, split):
    _, many = _compare(tiny_models["llama"], dict(quantization="int4", quantization_group_size=32), split)
    many.close()


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_blocks_as_stored_split_over_ranks(tiny_models, tmp_path, split, tied):
    """A GGUF of mixed types (Q4_0 q/k/v, Q4_1 o_proj and gate/up, Q8_0 down_proj and output, a Q8_0 v beside
    Q4_0 q/k in block 0: each part in its own blocks): every rank copies its slice of the file's blocks."""
    from gguf_writer import llama_gguf

    kinds = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
    types = {"output.weight": "Q8_0", "token_embd.weight": "Q4_1", "blk.0.attn_v.weight": "Q8_0"}
    path = llama_gguf(tiny_models["llama"], tmp_path / "tiny-q.gguf", kinds, types, tied)
    one, many = _compare(path, dict(quantization="gguf"), split)
    try:
        whole = one.engine.runner.model
        rank0 = many.engine.runner.tp.model
        assert type(rank0.layers[0].self_attn.qkv_proj).__name__ == "SplitQuantLinear"  # as in one process
        assert type(whole.layers[0].self_attn.qkv_proj).__name__ == "SplitQuantLinear"
        if "tensor_parallel_size" in split:
            down = rank0.layers[0].mlp.down_proj
            assert type(down).__name__ == "QuantRowParallelLinear"
            assert torch.equal(down.blocks, whole.layers[0].mlp.down_proj.blocks[:, : down.blocks.shape[1]])
        head_blocks = rank0.lm_head.blocks
        assert (head_blocks is rank0.embed_tokens.blocks) == tied
    finally:
        many.close()


def test_a_split_that_cuts_a_block_is_refused(tiny_models):
    """int4's default group of 128 takes the tiny model's 128 MLP neurons as one run, fewer than the ranks; its
    64 o_proj inputs are one group of 64, which TP 2 would cut in half (group 32 fits both)."""
    from tapllm.parallel.quant_shard import check_head_split
    from tapllm.quant.schemes import parse_quantization

    with pytest.raises(ValueError, match=r"intermediate_size=128 does not split into at least 2 runs of 128"):
        LLM(tiny_models["llama"], quantization="int4", tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match=r"o_proj's 64 inputs in blocks of 64.*rank 0 query heads 0\.\.1 "
                                         r"\(num_attention_heads=4 of head_dim=16.*quantization_group_size=32 fits"):
        check_head_split(parse_quantization("int4"), 4, 16, [(0, 2), (2, 2)], 2)
    check_head_split(parse_quantization("int4", 32), 4, 16, [(0, 2), (2, 2)], 2)


def test_neurons_split_on_block_boundaries():
    """A Qwen2.5-0.5B-shaped MLP (4864 neurons, 19 super-blocks of 256) splits 2560 + 2304 for Q4_K blocks."""
    parts = [ShardLayout(r, 2, num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936,
                         neuron_unit=256) for r in range(2)]
    assert parts[0].neuron_counts == [2560, 2304]
    assert [(p.neuron_start, p.neurons) for p in parts] == [(0, 2560), (2560, 2304)]
    plain = ShardLayout(1, 2, num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936)
    assert plain.neuron_counts == [2432, 2432]
