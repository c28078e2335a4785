"""Uneven tensor-parallel splits: ranks holding different numbers of heads, neurons or vocabulary rows.

SmolLM2-135M (9 query heads in 3 KV groups) at TP 2: rank 0 holds KV groups 0-1 (6 query heads,
2 KV heads), rank 1 group 2 (3 + 1); each registered family's tiny model, given 3 KV groups, an odd
MLP width and an odd vocabulary, splits all of them unevenly. Each equals one process: greedy tokens
identical, states within 1e-5 in float32. Plans give each rank its own sizes and bytes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from helpers import assert_close, greedy
from tapllm import LLM, HiddenStatesSpec, Steer
from tapllm.parallel import ShardLayout, divisibility_problems, plan_split
from tapllm.parallel.layout import balanced
from test_tp_plan import LLAMA_70B

ENGINE = dict(dtype="float32", kv_cache_blocks=48, max_num_batched_tokens=32)


def _same(outs_one, outs_two, points) -> None:
    for a, b in zip(outs_one, outs_two, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
        for point in points:
            assert_close(b.hidden_states[point], a.hidden_states[point], 1e-5)


def test_layout_gives_ranks_whole_kv_groups_and_refuses_what_cannot_split():
    parts = [ShardLayout(r, 2, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1537, vocab_size=49153)
             for r in range(2)]
    assert [(p.head_start, p.heads) for p in parts] == [(0, 6), (6, 3)]
    assert [(p.kv_head_start, p.kv_heads) for p in parts] == [(0, 2), (2, 1)]
    assert [(p.neuron_start, p.neurons) for p in parts] == [(0, 769), (769, 768)]
    assert [(p.vocab_start, p.vocab) for p in parts] == [(0, 24577), (24577, 24576)]
    assert parts[1].head_counts == [6, 3] and parts[1].kv_head_counts == [2, 1] and parts[0].kv_replicas == 1
    assert "6 + 3 of 9 query heads, 2 + 1 of 3 KV heads (split)" in parts[0].parts_text()
    assert [balanced(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    # the even and replicated splits are as before
    even = ShardLayout(1, 3, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152)
    assert (even.head_start, even.heads, even.kv_head_start, even.kv_heads) == (3, 3, 1, 1)
    rep = [ShardLayout(r, 4, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=64, vocab_size=100)
           for r in range(4)]
    assert [p.kv_head_start for p in rep] == [0, 0, 1, 1] and [p.head_start for p in rep] == [0, 2, 4, 6]
    # 9 heads in 3 KV groups over 4 ranks: neither whole groups per rank nor replicated groups
    with pytest.raises(ValueError, match="num_key_value_heads=3 is fewer than the 4 ranks and does not divide"):
        ShardLayout(0, 4, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152)
    assert any("num_attention_heads=4 is fewer than the 5 ranks" in p
               for p in divisibility_problems(5, num_heads=4, num_kv_heads=4, intermediate_size=128, vocab_size=99))
    # replicated KV heads need the query heads to split evenly
    assert any("num_attention_heads=6 is not a multiple of 4" in p
               for p in divisibility_problems(4, num_heads=6, num_kv_heads=2, intermediate_size=128, vocab_size=99))
    assert any("intermediate_size=2 is fewer" in p
               for p in divisibility_problems(3, num_heads=3, num_kv_heads=3, intermediate_size=2, vocab_size=99))


def test_plan_builds_each_rank_with_its_own_size(default_model_folder):
    plan = plan_split(default_model_folder, 2, "float32")
    a, b = plan.ranks
    assert (a.layout.heads, b.layout.heads, a.layout.kv_heads, b.layout.kv_heads) == (6, 3, 2, 1)
    assert a.weight_bytes > b.weight_bytes and a.kv_bytes_per_token == 2 * b.kv_bytes_per_token
    assert "6 + 3 of 9 query heads, 2 + 1 of 3 KV heads" in str(plan)
    big = plan_split(LLAMA_70B, 3, "bfloat16")  # 8 KV groups over 3 ranks: 3 + 3 + 2
    assert [r.layout.heads for r in big.ranks] == [24, 24, 16]
    assert [r.layout.kv_head_start for r in big.ranks] == [0, 3, 6]
    # 9558 + 9557 + 9557 MLP neurons: rank 0 holds the most
    assert big.ranks[0].weight_bytes > big.ranks[1].weight_bytes > big.ranks[2].weight_bytes


def test_plan_of_an_uneven_split_equals_what_the_engine_holds(odd_model):
    """Each rank planned with its own sizes: its weight and KV bytes are those of a real TP 2 engine."""
    plan = plan_split(odd_model, 2, "float32")
    a, b = plan.ranks
    assert (a.layout.heads, b.layout.heads, a.layout.neurons, b.layout.vocab) == (4, 2, 66, 24577)
    two = LLM(odd_model, tensor_parallel_size=2, dtype="float32", load_format="dummy", kv_cache_blocks=8)
    try:
        runner = two.engine.runner
        assert runner.tp.weight_bytes == [a.weight_bytes, b.weight_bytes] and a.weight_bytes > b.weight_bytes
        held = sum(c.nbytes for pair in runner.kv_caches for c in pair)  # rank 0's cache, padding block included
        tokens = (runner.num_blocks + 1) * 16
        assert held == tokens * a.kv_bytes_per_token == 2 * tokens * b.kv_bytes_per_token
        described = two.describe()
        assert f"{a.weight_bytes / 1e6:.1f} MB, {b.weight_bytes / 1e6:.1f} MB" in described
        assert f"{held / 1e9:.3f} + {held / 2e9:.3f} GB per rank" in described
        assert "4 + 2 of 6 query heads, 2 + 1 of 3 KV heads (split), 66 + 65 of 131 MLP neurons" in described
    finally:
        two.close()


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory, default_model_folder):
    """A tiny Llama with 6 query heads in 3 KV groups, an odd MLP width and an odd vocabulary."""
    from transformers import LlamaConfig

    from conftest import TINY, save_tiny_model

    cfg = LlamaConfig(vocab_size=49155, tie_word_embeddings=False,
                      **{**TINY, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
                         "intermediate_size": 131})
    return save_tiny_model(tmp_path_factory.mktemp("uneven") / "odd", cfg, default_model_folder)


def test_odd_neurons_and_vocabulary_equal_one_process(odd_model):
    one = LLM(odd_model, enforce_eager=True, **ENGINE)
    two = LLM(odd_model, tensor_parallel_size=2, **ENGINE)
    try:
        lay = two.engine.runner.tp.layout
        assert (lay.neuron_counts, lay.vocab_counts, lay.head_counts) == ([66, 65], [24578, 24577], [4, 2])
        points = ["resid_post", "attn_out", "mlp_out", "q", "k", "v", "z", "mlp_post", "attn_pattern", "final"]
        spec = HiddenStatesSpec(layers="all", points=points, positions="all", lens=3)
        steers = [Steer(layers=[1], point="z", vector=torch.ones(16), scale=2.0, heads=[1, 5]),
                  Steer(layers=[0], point="mlp_post", op="scale", scale=0.0, neurons=[3, 65, 66, 130])]
        prompts = random_prompts([7, 40], seed=6)  # 40 > the budget of 32: chunked prefill
        params = [greedy(5, hidden_states=spec), greedy(5, hidden_states=spec, steering=steers)]
        a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
        _same(a, b, points)
        _same_lens(a, b)
        per_rank = two.engine.runner.tp.weight_bytes
        assert per_rank[0] > per_rank[1]
    finally:
        two.close()


def _same_lens(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.hidden_states.lens
        for point in x.hidden_states.lens:
            assert torch.equal(x.hidden_states.lens[point].token_ids, y.hidden_states.lens[point].token_ids)
            assert_close(y.hidden_states.lens[point].logprobs, x.hidden_states.lens[point].logprobs, 1e-5)


@pytest.mark.slow
def test_default_model_at_two_ranks(default_model_folder):
    """SmolLM2-135M at TP 2: 6 + 3 query heads, 2 + 1 KV heads."""
    one = LLM(default_model_folder, enforce_eager=True, dtype="float32", kv_cache_blocks=32)
    two = LLM(default_model_folder, tensor_parallel_size=2, dtype="float32", kv_cache_blocks=32)
    try:
        tp = two.engine.runner.tp
        assert tp.layout.head_counts == [6, 3] and len(tp.procs) == 1
        assert "6 + 3 of 9 query heads, 2 + 1 of 3 KV heads (split)" in two.describe()
        points = ["resid_post", "attn_out", "mlp_out", "q", "k", "v", "z", "mlp_post", "attn_pattern"]
        spec = HiddenStatesSpec(layers=[0, 15, -1], points=points, positions="all", lens=3)
        hidden_head = 64
        # heads 4 (rank 0) and 7 (rank 1): a steer at z on both ranks
        steer = [Steer(layers=[15], point="z", vector=torch.ones(hidden_head), scale=3.0, heads=[4, 7])]
        prompts = ["The capital of France is", "Once upon a time, in a land far away,"]
        params = [greedy(4, hidden_states=spec), greedy(4, hidden_states=spec, steering=steer)]
        a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
        _same(a, b, points)
        _same_lens(a, b)
        plain = one.generate(prompts[1:], greedy(4, hidden_states=spec), use_tqdm=False)[0]
        assert not torch.equal(plain.hidden_states["resid_post"], a[1].hidden_states["resid_post"])  # it steered
    finally:
        two.close()


# Every registered family's checkpoint layout (fused q/k/v and gate/up, Conv1D, per-head q/k/v, OLMo-2's
# norms over every head) split unevenly: 6 query heads in 3 KV groups (3 heads where q/k/v share heads),
# an odd MLP width and an odd vocabulary.
UNEVEN_FAMILIES = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3-longrope",
                   "olmo2", "gpt2", "pythia"]


@pytest.fixture(scope="module")
def uneven_family_folders(tmp_path_factory, default_model_folder):
    from conftest import save_tiny_model
    from family_configs import family_configs

    root = tmp_path_factory.mktemp("tp-uneven-families")
    out = {}
    for name, cfg in family_configs().items():
        if name not in UNEVEN_FAMILIES:
            continue
        cfg.vocab_size = 49155
        if name == "gpt2":
            cfg.n_embd, cfg.n_head, cfg.n_inner = 48, 3, 131
        elif name == "pythia":
            cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size = 48, 3, 131
        else:
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads = 96, 6, 3
            cfg.intermediate_size = 131  # head_dim stays 16 (96 / 6), or the config's own (Qwen3, Gemma)
        out[name] = save_tiny_model(root / name, cfg, default_model_folder)
    return out


@pytest.mark.parametrize("family", UNEVEN_FAMILIES)
def test_every_family_split_unevenly_equals_one_process(family, uneven_family_folders):
    folder = uneven_family_folders[family]
    one = LLM(folder, enforce_eager=True, **ENGINE)
    two = LLM(folder, tensor_parallel_size=2, **ENGINE)
    try:
        lay = two.engine.runner.tp.layout
        assert lay.head_counts in ([4, 2], [2, 1]) and lay.neuron_counts == [66, 65], lay
        assert lay.vocab_counts == [24578, 24577]
        hidden = one.engine.model_config.hidden_size
        points = ["resid_post", "attn_out", "q", "k", "z", "mlp_post", "final"]
        spec = HiddenStatesSpec(layers="all", points=points, positions="all")
        steer = [Steer(layers=[1], point="resid_mid", vector=torch.ones(hidden), scale=0.5),
                 Steer(layers=[0], point="mlp_post", op="scale", neurons=[1, 65, 66, 100], scale=0.0)]
        prompts = random_prompts([7, 40], seed=6)
        params = [greedy(5, hidden_states=spec), greedy(5, hidden_states=spec, steering=steer)]
        _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False), points)
    finally:
        two.close()
