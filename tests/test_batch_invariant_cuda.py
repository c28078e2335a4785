"""batch_invariant=True on the CUDA backend: a request alone and in a mixed batch give the same bits.

Without a GPU the CUDA backend runs on the CPU, its Triton kernels (the invariant GEMM, the attention
with every key tile masked, the norms) in Triton's interpreter and its graphs emulated; ``-m cuda``
runs the same comparison on a GPU with real graphs (not run yet: no GPU was available). A mixed batch
(greedy with logprobs, seeded sampling with n > 1, steering, states with a projection) runs chunked
with eager CUDA steps (mixed prefill and decode steps), and through decode and mixed graphs; each
request must equal, bit for bit, what it gives alone on the same path, in bfloat16 and float32. Small on purpose:
interpreted Triton is slow.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, random_prompts, save_tiny_model
from helpers import greedy, same_alone_and_together
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.kernels import triton_linear

interpreted = pytest.mark.skipif(not triton_linear.available(torch.device("cpu")),
                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.cuda)]

NEW = 4
VOCAB = 1024  # the LM head is most of a step's time in Triton's interpreter


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, default_model_folder):
    """A tiny Llama of two blocks, a small vocabulary and a tied LM head (the invariant GEMM reads the embedding)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **{**TINY, "num_hidden_layers": 2})
    return save_tiny_model(tmp_path_factory.mktemp("small_vocab") / "llama", cfg, default_model_folder)


def _requests(hidden: int) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    v = torch.randn(hidden, generator=g)
    prefix = random_prompts([18], seed=3, vocab=VOCAB)[0]
    prompts = [prefix + t for t in random_prompts([5, 9], seed=4, vocab=VOCAB)] + random_prompts([12, 3], seed=6,
                                                                                                 vocab=VOCAB)
    params = [
        greedy(NEW, logprobs=2),
        greedy(NEW, steering=[Steer(layers=[1], point="resid_post", vector=v * 4 / v.norm(), scale=1.5)],
               hidden_states=HiddenStatesSpec(layers="all", points=["resid_post", "attn_out"], positions="all")),
        SamplingParams(n=2, max_tokens=NEW, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        greedy(NEW, hidden_states=HiddenStatesSpec(layers=[0, -1], points="resid_post", positions="all",
                                                   reduce="mean", project=torch.stack([v, -v]))),
    ]
    return list(zip(prompts, params, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_is_the_same_alone_and_in_a_batch_on_the_cuda_backend(dtype, device, small_vocab_model):
    path = small_vocab_model
    common = dict(dtype=dtype, device=device, backend="cuda", batch_invariant=True, block_size=8)
    no_graphs = dict(cuda_graph_sizes=[], cuda_graph_token_sizes=[])
    solo = LLM(path, **common, **no_graphs, enable_prefix_caching=False)
    assert "batch invariant: on: linears in a Triton GEMM" in solo.describe()
    requests = _requests(solo.engine.model_config.hidden_size)
    alone = [solo.generate([p], params, use_tqdm=False)[0] for p, params in requests]
    prompts, params = [p for p, _ in requests], [q for _, q in requests]
    # eager CUDA steps: chunks of at most 11 tokens beside decodes (mixed steps)
    eager = LLM(path, **common, **no_graphs, max_num_batched_tokens=11, max_num_seqs=4)
    together = eager.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        same_alone_and_together(a, b, f"eager steps, request {i}")
    # from CUDA graphs (decode and mixed buckets; emulated on the CPU): each request alone, then the batch,
    # in one engine (the later runs hit the prefix cache the earlier ones filled)
    graphed = LLM(path, **common, max_num_batched_tokens=16, max_num_seqs=4, cuda_graph_sizes=[1, 2, 4],
                  cuda_graph_token_sizes=[16])
    alone = [graphed.generate([p], q, use_tqdm=False)[0] for p, q in requests]
    together = graphed.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics["num_cached_tokens"] for o in together) > 0
    assert graphed.engine.runner.policy.graph_steps > 0
    assert {k.kind for k in graphed.engine.runner.graph_step.graphs.replays} == {"decode", "mixed"}
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        same_alone_and_together(a, b, f"graph steps, request {i}")


@interpreted
def test_the_invariant_linear_keeps_a_rows_bits_at_any_row_count():
    """Rows alone, among others and at any place of a 64-row tile: the same bits; close to F.linear."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(150, 96, generator=g).to(dtype)
        w, b = (torch.randn(100, 96, generator=g) / 10).to(dtype), torch.randn(100, generator=g).to(dtype)
        whole = triton_linear.invariant_linear(x, w, b)
        torch.testing.assert_close(whole.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                                   rtol=2e-2, atol=2e-2)
        for first, rows in ((0, 1), (77, 1), (3, 64), (63, 2), (10, 140)):
            part = triton_linear.invariant_linear(x[first : first + rows], w, b)
            assert torch.equal(part, whole[first : first + rows]), (dtype, first, rows)
        assert torch.equal(triton_linear.invariant_linear(x[:5].view(5, 1, 96), w, None).view(5, 100),
                           triton_linear.invariant_linear(x[:5], w, None))


@pytest.mark.parametrize("device", DEVICES)
def test_the_invariant_kernels_pass_their_trial(device):
    from tapllm.backends.cuda_invariant import invariant_trial

    for dtype in (torch.float32, torch.bfloat16):
        assert invariant_trial(torch.device(device), dtype) is None
