"""A request's states do not depend on batching, chunking, prefix caching, preemption or copy path."""

from __future__ import annotations

import pytest

from conftest import random_prompts
from helpers import greedy
from tapllm import LLM, HiddenStatesSpec, SamplingParams

NEW = 8
TARGET = HiddenStatesSpec(layers=[0, -1], points=["resid_pre", "attn_out", "mlp_out", "final"], positions="all")


def _others(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Companions: other layers and points, reductions, windows, and requests capturing nothing."""
    specs = [
        None,
        HiddenStatesSpec(layers=[1], points="resid_post", positions="prompt"),
        HiddenStatesSpec(layers="all", points=["resid_mid", "final"], positions="generated", reduce="mean"),
        HiddenStatesSpec(layers=[-1], points="attn_out", positions=(3, 9)),
        None,
        HiddenStatesSpec(points="final", positions="last"),
        HiddenStatesSpec(layers=[0, 2], points="mlp_out", positions="last_prompt", dtype="bfloat16"),
        HiddenStatesSpec(layers=[1], points=["attn_pattern", "q"], positions=(2, 12), heads=[1]),
        HiddenStatesSpec(layers=[2], points=["k", "mlp_post"], positions="all", reduce="mean"),
    ]
    prompts = random_prompts([5 + 7 * i for i in range(n)], seed=11)
    return prompts, [greedy(NEW, hidden_states=specs[i % len(specs)]) for i in range(n)]


def _assert_same(a, b, what: str) -> None:
    """Same tokens, positions and layers; states within 1e-5 of their scale.

    Exact equality is not expected: a chunk or a batch of another shape runs matmuls of
    another shape, which round differently in float32.
    """
    assert a.outputs[0].token_ids == b.outputs[0].token_ids, what
    ha, hb = a.hidden_states, b.hidden_states
    assert ha.positions.tolist() == hb.positions.tolist(), what
    assert ha.points == hb.points and ha.layers == hb.layers
    for point in ha.points:
        assert ha[point].shape == hb[point].shape, (what, point)
        scale = max(1.0, float(ha[point].float().abs().max()))
        err = float((ha[point].float() - hb[point].float()).abs().max()) if ha[point].numel() else 0.0
        assert err <= 1e-5 * scale, f"{what}: {point} differs by {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_states_in_every_situation(arch, tiny_models):
    path = tiny_models[arch]
    target = random_prompts([45], seed=5)[0]
    alone = LLM(path, dtype="float32").generate([target], greedy(NEW, hidden_states=TARGET), use_tqdm=False)[0]
    assert alone.hidden_states["resid_pre"].shape == (45 + NEW - 1, 2, 64)

    # a batch of 16, the target in the middle, with companions capturing other things or nothing
    prompts, params = _others(15)
    batch = LLM(path, dtype="float32").generate(
        prompts[:7] + [target] + prompts[7:], params[:7] + [greedy(NEW, hidden_states=TARGET)] + params[7:],
        use_tqdm=False
    )
    _assert_same(alone, batch[7], "batch of 16")
    assert batch[0].hidden_states is None and batch[4].hidden_states is None

    # chunked prefill under a 7-token budget
    chunked = LLM(path, dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False)
    _assert_same(alone, chunked.generate([target], greedy(NEW, hidden_states=TARGET), use_tqdm=False)[0],
                 "chunked prefill")

    # preemption: a cache too small for everything, the target admitted last so it is the victim
    small = LLM(path, dtype="float32", kv_cache_blocks=12, block_size=8, enable_prefix_caching=False)
    outs = small.generate(prompts[:3] + [target], params[:3] + [greedy(NEW, hidden_states=TARGET)], use_tqdm=False)
    assert outs[-1].metrics["num_preemptions"] > 0
    _assert_same(alone, outs[-1], "preempted and recomputed")

    # preemption with chunking and prefix caching at once
    mixed = LLM(path, dtype="float32", kv_cache_blocks=10, block_size=8, max_num_batched_tokens=9)
    outs = mixed.generate(prompts[:5] + [target], params[:5] + [greedy(NEW, hidden_states=TARGET)], use_tqdm=False)
    assert outs[-1].metrics["num_preemptions"] > 0
    assert outs[3].metrics["num_preemptions"] > 0  # a companion with a position window
    _assert_same(alone, outs[-1], "preempted, chunked, cached")
    for a, b in zip(outs[:5], batch[:5]):  # reductions and windows survive preemption too
        if a.hidden_states is not None:
            _assert_same(a, b, "preempted companions")

    # the staged copy path (used on CUDA: one pinned copy per step), exercised on CPU
    staged = LLM(path, dtype="float32")
    staged.engine.runner.capture_sink.staged = True
    outs = staged.generate(
        prompts[:7] + [target] + prompts[7:], params[:7] + [greedy(NEW, hidden_states=TARGET)] + params[7:],
        use_tqdm=False
    )
    _assert_same(alone, outs[7], "staged copies")
    for a, b in zip(outs, batch):
        if a.hidden_states is not None:
            _assert_same(a, b, "staged companions")


def test_prefix_cache_hit_still_gives_complete_prompt_states(tiny_models):
    path = tiny_models["llama"]
    shared = random_prompts([40], seed=7)[0]
    target = shared + random_prompts([9], seed=8)[0]
    alone = LLM(path, dtype="float32", enable_prefix_caching=False).generate(
        [target], greedy(NEW, hidden_states=TARGET), use_tqdm=False
    )[0]

    llm = LLM(path, dtype="float32", block_size=8)
    llm.generate([shared + [5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm cache
    plain, capturing = llm.generate([target, target], [SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
                                                       greedy(NEW, hidden_states=TARGET)], use_tqdm=False)
    assert plain.metrics["num_cached_tokens"] == 40  # others keep their hits
    assert capturing.metrics["num_cached_tokens"] == 0  # prompt positions are recomputed for it
    _assert_same(alone, capturing, "after a prefix-cache hit")
    assert plain.outputs[0].token_ids == alone.outputs[0].token_ids

    # a request that captures only generated positions keeps its cache hits
    gen_spec = HiddenStatesSpec(layers=[0, -1], points=["resid_post"], positions="generated")
    ref = LLM(path, dtype="float32", enable_prefix_caching=False).generate(
        [target], greedy(NEW, hidden_states=gen_spec), use_tqdm=False
    )[0]
    hit = llm.generate([target], greedy(NEW, hidden_states=gen_spec), use_tqdm=False)[0]
    assert hit.metrics["num_cached_tokens"] == 48
    _assert_same(ref, hit, "generated positions after a cache hit")


def test_states_belong_to_their_request(tiny_models):
    """Distinct prompts in one batch: each request's prompt states equal its own encode()."""
    llm = LLM(tiny_models["qwen3"], dtype="float32", max_num_batched_tokens=32)
    prompts = random_prompts([3, 17, 30, 8, 12, 25], seed=21)
    spec = HiddenStatesSpec(layers="all", points="resid_post", positions="prompt")
    outs = llm.generate(prompts, greedy(NEW, hidden_states=spec), use_tqdm=False)
    enc = llm.encode(prompts, spec, use_tqdm=False)
    for p, o, e in zip(prompts, outs, enc):
        assert e.outputs == [] and e.hidden_states["resid_post"].shape == (len(p), 3, 64)
        a, b = o.hidden_states["resid_post"], e.hidden_states["resid_post"]
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(a.abs().max()))


HEADS = HiddenStatesSpec(layers=[0, 2], points=["q", "k", "v", "z", "attn_pattern", "mlp_post"], positions="all",
                         heads=[3, 0])


@pytest.mark.parametrize("arch", ["llama", "gemma-like-window"])
def test_head_points_are_the_same_in_every_situation(arch, tiny_models, tmp_path):
    """The points inside attention and the MLP (patterns included) do not depend on the schedule."""
    import json
    import shutil

    path = tiny_models["llama" if arch == "llama" else "mistral"]
    if arch != "llama":  # a sliding window, so the pattern's mask is not plain causal
        path = tmp_path / "windowed"
        shutil.copytree(tiny_models["mistral"], path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["sliding_window"] = 8
        (path / "config.json").write_text(json.dumps(cfg))
    target = random_prompts([29], seed=6)[0]
    alone = LLM(path, dtype="float32").generate([target], greedy(NEW, hidden_states=HEADS), use_tqdm=False)[0]
    hs = alone.hidden_states
    n = 29 + NEW - 1
    assert hs["attn_pattern"].shape == (n, 2, 2, n) and hs["q"].shape == (n, 2, 2, 16)
    assert hs["k"].shape == (n, 2, 2, 16) and hs["mlp_post"].shape == (n, 2, 128)
    prompts, params = _others(9)
    situations = {
        "batched": LLM(path, dtype="float32"),
        "chunked": LLM(path, dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False),
        "preempted": LLM(path, dtype="float32", block_size=4, kv_cache_blocks=40, enable_prefix_caching=False),
    }
    for what, llm in situations.items():
        out = llm.generate(prompts[:4] + [target] + prompts[4:],
                           params[:4] + [greedy(NEW, hidden_states=HEADS)] + params[4:], use_tqdm=False)[4]
        _assert_same(out, alone, what)
    assert situations["preempted"].engine.scheduler.num_preemptions > 0
    cached = LLM(path, dtype="float32", block_size=4)
    cached.generate([target], greedy(NEW, hidden_states=None), use_tqdm=False)
    hit = cached.generate([target], greedy(NEW, hidden_states=HEADS), use_tqdm=False)[0]
    _assert_same(hit, alone, "after a prefix-cache hit")
