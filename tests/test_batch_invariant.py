"""batch_invariant=True: a request alone and in a mixed batch give the same bits.

The batch mixes steered requests (every op, several points), requests capturing at every point kind
(with reductions, projections, windows, the logit lens), sampled requests with n > 1, logprobs and
prompt logprobs, under a budget that chunks every prompt, a KV cache that forces preemption, and
shared prefixes that hit the prefix cache. Each request's tokens, logprobs and states must equal, bit
for bit, what it gives alone in an engine that neither chunks nor preempts: in bfloat16 and float32,
on the fused CPU backend and on the eager one.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, random_prompts, save_tiny_model
from helpers import greedy, same_alone_and_together
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer

NEW = 6


def _vec(seed: int, width: int, norm: float = 4.0) -> torch.Tensor:
    v = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    return v * (norm / v.norm())


def _requests(hidden: int, head_dim: int, inter: int) -> list[tuple[list[int], SamplingParams]]:
    """The mixed batch: prompts sharing a 34-token prefix (prefix-cache hits), and every feature."""
    prefix = random_prompts([34], seed=3)[0]
    tails = random_prompts([5, 11, 17, 9, 23, 4, 13, 30, 7], seed=4)
    # the prefix of the first prompt is cached for those that neither steer nor capture the prompt
    prompts = ([prefix + t for t in tails[:3]] + tails[3:7] + [prefix + tails[7], prefix[:20] + tails[0],
                                                               prefix + tails[8]])
    every_point = ["embed", "resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "final"]
    params = [
        greedy(NEW, logprobs=3),
        greedy(NEW, steering=[
            Steer(layers=[0, 2], point="resid_post", op="add", vector=_vec(1, hidden), scale=1.5),
            Steer(layers=[1], point="attn_out", op="scale", scale=0.5),
            Steer(layers=[1], point="mlp_out", op="ablate", vector=_vec(2, hidden)),
            Steer(layers=[0], point="resid_mid", op="clamp", vector=_vec(3, hidden), value=2.0, positions="generated"),
        ], hidden_states=HiddenStatesSpec(layers="all", points=every_point, positions="all"), logprobs=2),
        greedy(NEW, hidden_states=HiddenStatesSpec(layers=[0, -1], points=["q", "k", "v", "z", "mlp_post"],
                                                   positions="all")),
        SamplingParams(n=2, max_tokens=NEW, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True, logprobs=1,
                       hidden_states=HiddenStatesSpec(layers=[1], points=["attn_pattern", "resid_post"],
                                                      positions=(2, 12))),
        greedy(NEW, steering=[
            Steer(layers=[1], point="q", op="add", vector=_vec(4, head_dim), heads=[1]),
            Steer(layers=[0], point="v", op="ablate", vector=_vec(5, head_dim), heads=[0]),
            Steer(layers=[2], point="mlp_post", op="scale", scale=1.5, neurons=[0, 5, 9]),
        ], hidden_states=HiddenStatesSpec(layers="all", points=["resid_post", "z"], positions="generated",
                                          reduce="mean", heads=[0, 1])),
        greedy(NEW, prompt_logprobs=2, hidden_states=HiddenStatesSpec(
            layers="all", points=["resid_post", "final"], positions="prompt", reduce="sum",
            project=torch.stack([_vec(6, hidden), _vec(7, hidden)]))),
        greedy(NEW, steering=[
            Steer(layers=[1], point="resid_pre", op="set", values=torch.ones(2, hidden), positions=[1, 3]),
            Steer(layers=[0], point="k", op="add", vector=_vec(8, head_dim)),
        ], hidden_states=HiddenStatesSpec(layers=[-1], points="resid_post", positions="last", lens=3)),
        SamplingParams(n=3, max_tokens=NEW, temperature=1.0, seed=11, ignore_eos=True,
                       hidden_states=HiddenStatesSpec(points=["mlp_out"], positions="last_prompt")),
        greedy(NEW, logprobs=4, hidden_states=HiddenStatesSpec(layers=[1], points=["attn_out", "resid_mid"],
                                                               positions="all", reduce="max")),
        greedy(NEW, logprobs=2, hidden_states=HiddenStatesSpec(layers=[0], points="resid_post",
                                                               positions="generated")),
    ]
    return list(zip(prompts, params, strict=True))


@pytest.fixture(scope="module")
def wide_head_model(tmp_path_factory, default_model_folder):
    """A tiny Llama with 64-dim heads: the bfloat16 attention's dot-product kernels take it."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **{**TINY, "hidden_size": 128,
                                                                     "num_attention_heads": 2,
                                                                     "num_key_value_heads": 1})
    return save_tiny_model(tmp_path_factory.mktemp("wide") / "llama", cfg, default_model_folder)


# The eager path's kernels do not depend on the head size: the wide model runs on the fused one only.
@pytest.mark.parametrize(("model", "dtype", "backend"), [
    (model, dtype, backend) for model, backends in (("llama", ("cpu", "eager")), ("wide", ("cpu",)))
    for dtype in ("bfloat16", "float32") for backend in backends])
def test_a_request_is_the_same_alone_and_in_any_batch(model, dtype, backend, tiny_models, wide_head_model):
    path = wide_head_model if model == "wide" else tiny_models["llama"]
    hidden, head_dim = (128, 64) if model == "wide" else (64, 16)
    requests = _requests(hidden, head_dim, TINY["intermediate_size"])
    common = dict(dtype=dtype, backend=backend, batch_invariant=True, block_size=8)
    solo = LLM(path, **common, enable_prefix_caching=False)
    assert "batch invariant: on" in solo.describe()
    alone = [solo.generate([p], params, use_tqdm=False)[0] for p, params in requests]
    # chunks of at most 13 tokens, a cache too small for the batch (preemption), prefix caching on
    busy = LLM(path, **common, max_num_batched_tokens=13, kv_cache_blocks=14, max_num_seqs=6)
    together = busy.generate([p for p, _ in requests], [params for _, params in requests], use_tqdm=False)
    assert sum(o.metrics["num_preemptions"] for o in together) > 0
    assert sum(o.metrics["num_cached_tokens"] for o in together) > 0
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        same_alone_and_together(a, b, f"request {i}")


def test_fused_and_eager_paths_take_the_invariant_kernels(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="bfloat16", batch_invariant=True)
    text = llm.describe()
    assert "batch invariant: on: the packed GEMV at every size" in text and "row_attention" in text
    eager = LLM(tiny_models["llama"], dtype="bfloat16", batch_invariant=True, enforce_eager=True)
    assert "batch invariant: on: linears and attention one row per call" in eager.describe()
    assert "batch invariant: off" in LLM(tiny_models["llama"], dtype="bfloat16").describe()


def test_refusals_name_the_field():
    from tapllm.backends import select_backend
    from tapllm.config import EngineConfig

    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineConfig(batch_invariant="yes").validate()
    with pytest.raises(ValueError, match="batch_invariant=True cannot be combined with quantization='int8'"):
        EngineConfig(batch_invariant=True, quantization="int8").validate()
    with pytest.raises(ValueError, match="batch_invariant=True cannot be combined with tensor_parallel_size > 1"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2).validate()
    for backend, eager in (("eager", False), ("auto", True)):  # PyTorch's own step on a GPU
        with pytest.raises(ValueError, match="batch_invariant=True needs the CPU or the CUDA backend's Triton kernels"):
            select_backend(torch.device("cuda"), torch.float32, backend=backend, enforce_eager=eager,
                           batch_invariant=True)
