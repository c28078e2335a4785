"""The CUDA backend's fused mixture-of-experts kernels (tapllm.kernels.triton_moe), in Triton's interpreter.

The kernels against the grouped PyTorch path (``grouped_experts``) on random inputs: float32 within
1e-5 of the output's scale, bfloat16 within its rounding, at one token, at steps where some experts get
no rows and where every pair goes to one expert, SiLU and GELU-tanh, float32 and model-dtype routing
weights. The device-side sort's invariants over random routings. Then an MoE model on the CUDA backend
(Triton interpreted, graphs emulated): its decode steps replay graphs (none captured after start-up),
its greedy tokens and logprobs equal transformers', its router points and router steers on the graph
path equal the eager step's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_configs import moe_configs
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.kernels import triton_moe
from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU
from tapllm.kernels.moe_blocks import max_padded, pair_blocks
from tapllm.models.experts import gated, grouped_experts

# The kernels run on a GPU where there is one, else in Triton's interpreter; the engine tests need the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_moe.available(DEVICE), reason="needs a GPU or Triton's interpreter")
interpreted = pytest.mark.skipif(not triton_moe.available(torch.device("cpu")),
                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
GELU_TANH = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731


def _case(tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int, one_expert: bool = False,
          hidden: int = 96, inter: int = 40) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    if one_expert:  # every pair to expert 2 (a token's choices repeat it: the kernels need not care)
        ids = torch.full((tokens, top_k), 2)
    else:  # distinct choices per token, from the first 3 experts only: the others get no rows
        ids = torch.stack([torch.randperm(min(experts, 3), generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    return tuple(t.to(DEVICE) for t in (x, weights, ids, gate_up, down))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = float(want.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: a rounding flipped by another order of a sum
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,one_expert", [(1, False), (5, False), (37, False), (9, True)])
def test_fused_experts_equal_grouped_experts(dtype, tokens, one_expert):
    x, weights, ids, gate_up, down = _case(tokens, 6, 2, dtype, seed=tokens, one_expert=one_expert)
    for act, fn in ((ACT_SILU, F.silu), (ACT_GELU_TANH, GELU_TANH)):
        for w in (weights, weights.to(dtype)):  # Mixtral's float32 weights; the others' in the model's dtype
            got = triton_moe.fused_experts(x, w, ids, gate_up, down, act)
            _close(got, grouped_experts(x, w, ids, gate_up, down, gated(fn)), dtype)


def test_fused_experts_top_k_beyond_two():
    """Eight choices of 16 experts (OLMoE's and Qwen3-MoE's shape, smaller): rows summed over every choice."""
    g = torch.Generator().manual_seed(5)
    x, weights, _, gate_up, down = _case(7, 16, 8, torch.float32, seed=5)
    ids = torch.stack([torch.randperm(16, generator=g)[:8] for _ in range(7)]).to(DEVICE)
    got = triton_moe.fused_experts(x, weights, ids, gate_up, down, ACT_SILU)
    _close(got, grouped_experts(x, weights, ids, gate_up, down, gated(F.silu)), torch.float32)


def test_fused_experts_refuses_what_it_does_not_compute():
    x, weights, ids, gate_up, down = _case(2, 4, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="act must be one of"):
        triton_moe.fused_experts(x, weights, ids, gate_up, down, 7)
    with pytest.raises(ValueError, match="share one dtype"):
        triton_moe.fused_experts(x, weights, ids, gate_up.double(), down, ACT_SILU)


@pytest.mark.parametrize("seed", range(25))
def test_pair_blocks_invariants(seed):
    """Every pair sits in exactly one slot, in a block of its expert, the expert's pairs in token order from the
    first slot of a block; the padding holds the sentinel; the blocks past the used ones have no expert."""
    g = torch.Generator().manual_seed(seed)
    tokens, experts = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    top_k = int(torch.randint(1, experts + 1, (1,), generator=g))
    block_m = [1, 4, 16][seed % 3]
    busy = int(torch.randint(1, experts + 1, (1,), generator=g))  # some routings touch a few experts only
    ids = torch.randint(0, busy, (tokens, top_k), generator=g)
    b = pair_blocks(ids.to(DEVICE), experts, block_m)
    b = type(b)(*(t.cpu() for t in b))
    n = tokens * top_k
    size = max_padded(n, experts, block_m)
    assert b.sorted_pairs.shape == (size,) and size % block_m == 0 and b.block_expert.shape == (size // block_m,)
    flat = ids.reshape(-1)
    assert torch.equal(b.sorted_pairs[b.pair_slot].long(), torch.arange(n))  # each pair at its own slot
    assert int((b.sorted_pairs == n).sum()) == size - n  # and the rest is padding
    assert torch.equal(b.block_expert[b.pair_slot // block_m].long(), flat)  # a pair's block is its expert's
    used = b.block_expert >= 0
    assert bool((used[:-1] >= used[1:]).all())  # the used blocks first
    counts = torch.bincount(flat, minlength=experts)
    assert int(used.sum()) == int(((counts + block_m - 1) // block_m).sum())
    owners = b.block_expert[used]
    assert bool((owners[1:] >= owners[:-1]).all())  # experts in ascending order
    for e in range(experts):
        slots = b.pair_slot[flat == e]
        if slots.numel():  # from a block's first slot, contiguous, in token order (a stable sort)
            assert int(slots[0]) % block_m == 0
            assert torch.equal(slots, slots[0] + torch.arange(slots.numel()))
            assert torch.equal(b.sorted_pairs[slots].long(), (flat == e).nonzero().squeeze(1))


# ---- an MoE model on the CUDA backend ------------------------------------------------------------------------

DECODE = [1, 2, 4]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, default_model_folder):
    """(checkpoint folder, the transformers model) of the tiny Qwen2-MoE: a shared expert and a dense block."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path_factory.mktemp("moe") / "qwen2_moe", moe_configs()["qwen2_moe"],
                             default_model_folder)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _graphed(folder) -> LLM:
    return LLM(folder, dtype="float32", backend="cuda", max_num_seqs=4, max_num_batched_tokens=32,
               cuda_graph_sizes=DECODE, cuda_graph_token_sizes=[32])


@interpreted
def test_moe_decode_steps_run_in_graphs_and_equal_transformers(moe_model):
    folder, model = moe_model
    prompts = random_prompts([4, 11, 7], seed=43)
    refs = [hf_greedy(model, p, 5) for p in prompts]
    llm = _graphed(folder)
    runner = llm.engine.runner
    assert runner.backend.name == "cuda" and runner.backend.moe is not None and runner.graph_step is not None
    assert "mixture-of-experts experts: fused kernels" in llm.describe()
    graphs = runner.graph_step.graphs
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, refs, atol=1e-5)
    policy = runner.policy
    assert policy.graph_steps > 0 and not policy.eager_steps, policy.eager_steps
    assert "decode" in {k.kind for k in graphs.replays} and graphs.captures_after_warmup == 0


@interpreted
def test_moe_router_points_and_steers_on_graph_path_equal_eager(moe_model):
    """Router points captured in tapped graph steps, and bans (at every position and at two), a force and a
    routing-weight scale, equal the eager step's: every tapped step replays a graph."""
    folder, _ = moe_model
    prompts = random_prompts([5, 9], seed=44)
    spec = HiddenStatesSpec(layers="all", points=["router_logits", "routing_weights", "experts_chosen"],
                            positions="all")
    steers = [Steer(point="router_logits", layers=[0], op="ban", experts=[1]),
              Steer(point="router_logits", layers=[2], op="force", experts=[3], positions="generated"),
              Steer(point="router_logits", layers=[2], op="ban", experts=[0], positions=[2, 3]),
              Steer(point="routing_weights", layers=[0], op="scale", scale=0.5, experts=[0])]
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0, hidden_states=spec),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0, hidden_states=spec,
                             steering=steers)]
    graphed = _graphed(folder)
    got = graphed.generate(prompts, params, use_tqdm=False)
    policy = graphed.engine.runner.policy
    assert policy.graph_steps > 0 and not policy.eager_steps, policy.eager_steps
    eager = LLM(folder, dtype="float32", enforce_eager=True)
    assert "row counts on the host" in eager.engine.runner.model.graphs_off  # (the grouped path there)
    assert graphed.engine.runner.model.graphs_off is None
    want = eager.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = [[lps[t].logprob for lps, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in (a, b)]
        torch.testing.assert_close(torch.tensor(lp[1]), torch.tensor(lp[0]), rtol=0, atol=1e-5)
        for point in spec.points:
            torch.testing.assert_close(b.hidden_states[point], a.hidden_states[point], rtol=0, atol=1e-5,
                                       equal_nan=True)
    chosen = got[1].hidden_states["experts_chosen"]  # [position, block, expert]: the steers acted
    assert not chosen[:, 0, 1].any() and bool((chosen[len(prompts[1]):, 2, 3] == 1).all())
    assert not chosen[2:4, 2, 0].any()
    assert chosen[:, 0, 1].numel() > len(prompts[1])


@interpreted
def test_expert_out_on_the_cuda_backend_runs_eagerly_and_equals_the_cpu(moe_model):
    """``expert_out`` is not a graph site (``[n_experts, hidden]`` a position): the steps of a request that
    captures it run eagerly, saying why, through the grouped loop (the fused kernels keep no expert's own
    rows), and equal the CPU's; ``shared_expert_out``, a site, rides in the graph beside it."""
    folder, _ = moe_model
    prompts = random_prompts([6, 3], seed=45)
    spec = HiddenStatesSpec(layers="all", points=["expert_out", "shared_expert_out"], positions="all",
                            experts=[0, 2])
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, hidden_states=spec),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                             hidden_states=HiddenStatesSpec(layers="all", points=["shared_expert_out"]))]
    graphed = _graphed(folder)
    got = graphed.generate(prompts, params, use_tqdm=False)
    policy = graphed.engine.runner.policy
    assert policy.eager_steps and all("expert outputs are captured" in str(why) for why in policy.eager_steps)
    want = LLM(folder, dtype="float32", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for point, value in a.hidden_states.items():
            torch.testing.assert_close(b.hidden_states[point], value, rtol=0, atol=1e-5, equal_nan=True)
    routed = got[0].hidden_states["expert_out"].abs().sum(-1)  # [position, block, 2]: rows where routed
    assert bool((routed > 0).any()) and bool((routed == 0).any())
