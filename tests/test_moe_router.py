"""The router as a tap: its points and its steers, in every mixture-of-experts family, against transformers.

Points: ``router_logits``, ``router_probs``, ``routing_weights`` and ``experts_chosen`` at every block and
position of a batched, chunked generate equal what transformers' routers compute (read by a forward hook
on each router), NaN at a dense block; their sums and means over a prompt reduce on the device.

Steers: each op (ban, force, a bias on the logits, scale and ablate an expert's output) gives the greedy
tokens and the logits (within 1e-5, float32) of transformers with the same edit: ban and bias through the
router's own code with its linear's output edited, force by a hook re-routing the router's logits, scale
and ablate by scaling the expert's down projection. A batch mixing a banned-expert request, a plain one
and a residual-steered one equals each alone; the prefix cache never serves a banned request KV computed
without the ban. Bad input is refused naming the field and the limit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch

from conftest import random_prompts, save_tiny_model
from family_configs import moe_configs
from family_harness import assert_close_states
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from test_family_moe import _init, _router  # the same weights' initialisation and router lookup

FAMILIES = sorted(moe_configs())
ROUTER_POINTS = ["router_logits", "router_probs", "routing_weights", "experts_chosen"]
NEW = 6
HIDDEN = 64


def _sparse(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if _router(layer.mlp) is not None]


@pytest.fixture(scope="module")
def moe(tmp_path_factory, default_model_folder):
    """family -> (checkpoint folder, the transformers model read back from it)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe_router")
    out = {}
    for name, cfg in moe_configs().items():
        folder = save_tiny_model(root / name, cfg, default_model_folder, init=_init)
        out[name] = (folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return out


@pytest.fixture(scope="module")
def llms(moe) -> Callable[[str], LLM]:
    """family -> one tapllm engine on its checkpoint (prompts run in chunks of 8 tokens), made on first use."""
    made: dict[str, LLM] = {}

    def get(family: str) -> LLM:
        if family not in made:
            made[family] = LLM(moe[family][0], dtype="float32", max_num_batched_tokens=8)
        return made[family]
    return get


@contextmanager
def _removed(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _hf_routes(model, seq: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per sparse block: transformers' router logits ``[T, E]``, top-k weights and expert ids ``[T, k]``."""
    found: list = []
    handles = [_router(model.model.layers[i].mlp).register_forward_hook(lambda m, a, o: found.append(o))
               for i in _sparse(model)]
    with torch.no_grad(), _removed(handles):
        model(input_ids=torch.tensor([seq]))
    return found


def _dense(ids: torch.Tensor, values: torch.Tensor | float, experts: int) -> torch.Tensor:
    """``[T, E]`` rows holding ``values`` at the expert ids ``ids`` ``[T, k]``, 0 elsewhere."""
    out = torch.zeros(ids.shape[0], experts)
    return out.scatter_(1, ids, values if isinstance(values, float) else values.float())


@pytest.mark.parametrize("family", FAMILIES)
def test_router_points_equal_transformers(family, moe, llms):
    """Every router point at every block and position of a batched, chunked generate; NaN at a dense block."""
    _, model = moe[family]
    prompts = random_prompts([1, 19, 6], seed=51)
    spec = HiddenStatesSpec(layers="all", points=ROUTER_POINTS, positions="all")
    outs = llms(family).generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                         hidden_states=spec), use_tqdm=False)
    sparse = _sparse(model)
    dense = [i for i in range(len(model.model.layers)) if i not in sparse]
    k = model.config.num_experts_per_tok
    for prompt, out in zip(prompts, outs):
        seq = (prompt + out.outputs[0].token_ids)[:-1]
        hs = out.hidden_states
        routes = _hf_routes(model, seq)
        logits = torch.stack([r[0] for r in routes], 1)  # [T, sparse blocks, E]
        n = logits.shape[-1]
        weights = torch.stack([_dense(r[2], r[1], n) for r in routes], 1)
        chosen = torch.stack([_dense(r[2], 1.0, n) for r in routes], 1)
        what = f"{family}, prompt of {len(prompt)}"
        assert hs["router_logits"].shape == (len(seq), len(model.model.layers), n)
        assert_close_states(hs["router_logits"][:, sparse], logits, f"router_logits ({what})", 1e-5)
        assert_close_states(hs["router_probs"][:, sparse], torch.softmax(logits.float(), -1),
                            f"router_probs ({what})", 1e-5)
        assert_close_states(hs["routing_weights"][:, sparse], weights, f"routing_weights ({what})", 1e-5)
        assert torch.equal(hs["experts_chosen"][:, sparse], chosen), what
        assert (hs["experts_chosen"][:, sparse].sum(-1) == k).all()
        for point in ROUTER_POINTS:
            assert hs[point][:, dense].isnan().all(), point


def test_expert_counts_and_mean_probabilities_reduce_over_a_prompt(moe):
    """``sum`` of ``experts_chosen`` is each expert's token count, of ``routing_weights`` its total weight;
    ``mean`` of ``router_probs`` the load-balancing view: ``[layers, n_experts]`` each, through encode in
    chunks, NaN at the dense block."""
    _, model = moe["qwen2_moe"]
    llm = LLM(moe["qwen2_moe"][0], dtype="float32", block_size=4, max_num_batched_tokens=5)
    prompt = random_prompts([13], seed=52)[0]
    sums = HiddenStatesSpec(layers="all", points=["experts_chosen", "routing_weights"], positions="prompt",
                            reduce="sum")
    means = HiddenStatesSpec(layers="all", points=["router_probs"], positions="prompt", reduce="mean")
    summed, averaged = (o.hidden_states for o in llm.encode([prompt, prompt], [sums, means], use_tqdm=False))
    routes = _hf_routes(model, prompt)
    n = routes[0][0].shape[-1]
    counts = torch.stack([_dense(r[2], 1.0, n).sum(0) for r in routes])
    totals = torch.stack([_dense(r[2], r[1], n).sum(0) for r in routes])
    probs = torch.stack([torch.softmax(r[0].float(), -1).mean(0) for r in routes])
    sparse = _sparse(model)
    assert summed["experts_chosen"].shape == (3, n) and sparse == [0, 2]
    assert torch.equal(summed["experts_chosen"][sparse], counts)
    assert (counts.sum(-1) == 13 * model.config.num_experts_per_tok).all()
    assert torch.allclose(summed["routing_weights"][sparse], totals, atol=1e-5)
    assert torch.allclose(averaged["router_probs"][sparse], probs, atol=1e-5)
    assert summed["experts_chosen"][1].isnan().all() and averaged["router_probs"][1].isnan().all()


# --- routing steers against transformers with the same edit ---------------------------------------------------

OPS = ["ban", "force", "bias", "scale", "ablate"]


def _steers(op: str, model, prompt: list[int]) -> list[Steer]:
    """The steers of ``op`` at every sparse block: the block's busiest expert over ``prompt`` is banned,
    scaled by 3 or ablated, its idlest forced; ``bias`` adds a random vector to every block's logits."""
    routes = _hf_routes(model, prompt)
    n = routes[0][0].shape[-1]
    sparse = _sparse(model)
    if op == "bias":
        g = torch.Generator().manual_seed(53)
        return [Steer(layers=sparse, point="router_logits", op="add", vector=2.0 * torch.randn(n, generator=g))]
    out = []
    for layer, (_, _, ids) in zip(sparse, routes):
        counts = torch.bincount(ids.flatten(), minlength=n)
        busiest, idlest = int(counts.argmax()), int(counts.argmin())
        out.append({"ban": Steer(layers=[layer], point="router_logits", op="ban", experts=[busiest]),
                    "force": Steer(layers=[layer], point="router_logits", op="force", experts=[idlest]),
                    "scale": Steer(layers=[layer], point="routing_weights", op="scale", experts=[busiest], scale=3.0),
                    "ablate": Steer(layers=[layer], point="routing_weights", op="ablate", experts=[busiest]),
                    }[op])
    return out


def _edited_logits(router, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Run ``router``'s own forward with its linear's output (the logits) passed through ``edit``."""
    forward = router.forward
    linear = torch.nn.functional.linear

    def edited(*args, **kwargs):
        def lin(x, weight, bias=None):
            return edit(linear(x, weight, bias))
        with mock.patch.object(torch.nn.functional, "linear", lin):
            return forward(*args, **kwargs)
    router.forward = edited


def _forced(family: str, forced: list[int], k: int, renormalize: bool):
    """A forward hook re-routing a router's logits with ``forced`` experts always chosen: the top-k of the
    rest fills the other slots; the weights are the family's (softmax, gathered, renormalised where it does;
    gpt-oss: the softmax over the chosen logits)."""
    def hook(module, args, out):
        logits = out[0]
        if family == "gpt_oss":
            score = logits.clone()
            score[:, forced] = float("inf")
            ids = torch.topk(score, k, dim=-1).indices
            return logits, torch.softmax(logits.gather(1, ids), dim=-1), ids
        probs = torch.softmax(logits.float(), dim=-1)
        score = probs.clone()
        score[:, forced] = 2.0
        ids = torch.topk(score, k, dim=-1).indices
        weights = probs.gather(1, ids)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids
    return hook


@contextmanager
def _hf_edit(family: str, model, steers: list[Steer]) -> Iterator[None]:
    """transformers' ``model`` with the edits of ``steers`` (see the module docstring), undone on exit."""
    cfg = model.config
    with torch.no_grad(), ExitStack() as stack:  # the weights are restored inside no_grad
        for s in steers:
            for layer in s.layers:
                mlp = model.model.layers[layer].mlp
                router = _router(mlp)
                if s.op == "ban":
                    experts = list(s.experts)
                    _edited_logits(router, lambda x, e=experts: x.index_fill(-1, torch.tensor(e), float("-inf")))
                    stack.callback(delattr, router, "forward")
                elif s.op == "add":
                    _edited_logits(router, lambda x, v=s.vector: x + v)
                    stack.callback(delattr, router, "forward")
                elif s.op == "force":
                    renormalize = family == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
                    hook = _forced(family, list(s.experts), cfg.num_experts_per_tok, renormalize)
                    stack.enter_context(_removed([router.register_forward_hook(hook)]))
                else:  # scale / ablate an expert's output: its down projection (and bias) scaled
                    factor = 0.0 if s.op == "ablate" else s.scale
                    for name in ("down_proj", "down_proj_bias"):
                        p = getattr(mlp.experts, name, None)
                        if p is None:
                            continue
                        for e in s.experts:
                            saved = p[e].clone()
                            p[e] *= factor
                            stack.callback(lambda p=p, e=e, saved=saved: p[e].copy_(saved))
        yield


def _hf_greedy_logits(model, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (a whole forward per step, so every hook sees every position) and the logits of every
    position run."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        logits = model(input_ids=torch.tensor([seq[:-1]])).logits[0]
    return seq[len(prompt):], logits


def _tapllm_greedy_logits(llm: LLM, prompt: list[int], steers: list[Steer] | None, new: int
                          ) -> tuple[list[int], torch.Tensor]:
    spec = HiddenStatesSpec(points=["final"], positions="all")
    out = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, steering=steers,
                                                hidden_states=spec), use_tqdm=False)[0]
    return out.outputs[0].token_ids, llm.engine.runner.model.compute_logits(out.hidden_states["final"][:, 0])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("family", FAMILIES)
def test_routing_steer_equals_transformers_with_the_same_edit(family, op, moe, llms):
    _, model = moe[family]
    prompt = random_prompts([11], seed=54)[0]
    steers = _steers(op, model, prompt)
    tokens, logits = _tapllm_greedy_logits(llms(family), prompt, steers, NEW)
    with _hf_edit(family, model, steers):
        ref_tokens, ref_logits = _hf_greedy_logits(model, prompt, NEW)
    _, plain = _hf_greedy_logits(model, prompt, NEW)
    what = f"{family} {op}"
    assert tokens == ref_tokens, what
    assert_close_states(logits[:, None], ref_logits[:, None], f"logits ({what})", 1e-5)
    n = min(len(plain), len(ref_logits))
    assert not torch.allclose(ref_logits[:n], plain[:n], atol=1e-3), f"{what}: the edit changed nothing"


@contextmanager
def _hf_ban_at(model, layer: int, expert: int, positions: list[int]) -> Iterator[None]:
    """transformers' router of block ``layer`` with ``expert``'s logit -inf at ``positions`` only (one sequence)."""
    router = _router(model.model.layers[layer].mlp)

    def edit(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        rows = [p for p in positions if p < x.shape[0]]
        x[rows, expert] = float("-inf")
        return x
    _edited_logits(router, edit)
    try:
        yield
    finally:
        delattr(router, "forward")


@pytest.mark.parametrize("family", ["gpt_oss", "qwen2_moe"])
def test_a_ban_at_explicit_positions_equals_transformers_banning_there(family, moe):
    """A steer at explicit positions (prompt and generated ones) bans the expert at those rows only, on the
    eager path."""
    _, model = moe[family]
    prompt = random_prompts([11], seed=58)[0]
    layer = _sparse(model)[-1]
    counts = torch.bincount(_hf_routes(model, prompt)[-1][2].flatten(), minlength=4)
    expert, positions = int(counts.argmax()), [2, 5, 9, 12, 14]
    steer = Steer(layers=[layer], point="router_logits", op="ban", experts=[expert], positions=positions)
    llm = LLM(moe[family][0], dtype="float32", enforce_eager=True)
    tokens, logits = _tapllm_greedy_logits(llm, prompt, [steer], NEW)
    with _hf_ban_at(model, layer, expert, positions):
        ref_tokens, ref_logits = _hf_greedy_logits(model, prompt, NEW)
    _, plain = _hf_greedy_logits(model, prompt, NEW)
    assert tokens == ref_tokens
    assert_close_states(logits[:, None], ref_logits[:, None], f"logits ({family})", 1e-5)
    assert not torch.allclose(ref_logits, plain, atol=1e-3)
    # rows before the first steered position are untouched (to rounding: the ban regroups the later rows,
    # and transformers' expert GEMMs may sum a row in another order in a group of another size)
    assert_close_states(ref_logits[:2, None], plain[:2, None], f"unsteered rows ({family})", 1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_bfloat16_router_points_and_steers(family, moe):
    """In bfloat16: capturing the router points (which routes through the tap) leaves tokens and states bit for
    bit those of a run that captures nothing there; a ban and an expert scaled run, and the capture shows them."""
    folder, model = moe[family]
    llm = LLM(folder, dtype="bfloat16")
    prompts = random_prompts([7, 16], seed=59)
    final = HiddenStatesSpec(points=["final"], positions="all")
    router = HiddenStatesSpec(layers="all", points=["final", *ROUTER_POINTS], positions="all")
    plain = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, hidden_states=final),
                         use_tqdm=False)
    tapped = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                  hidden_states=router), use_tqdm=False)
    k = model.config.num_experts_per_tok
    sparse = _sparse(model)
    for a, b in zip(plain, tapped):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.equal(a.hidden_states["final"], b.hidden_states["final"])
        assert b.hidden_states["experts_chosen"].dtype == torch.bfloat16
        assert (b.hidden_states["experts_chosen"][:, sparse].sum(-1) == k).all()
    steers = [Steer(layers=sparse, point="router_logits", op="ban", experts=[0]),
              Steer(layers=sparse, point="routing_weights", op="scale", experts=[1], scale=0.5)]
    out = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=steers,
                                               hidden_states=router), use_tqdm=False)
    for o, t in zip(out, tapped):
        hs = o.hidden_states
        assert (hs["experts_chosen"][:, sparse, 0] == 0).all() and (hs["router_probs"][:, sparse, 0] == 0).all()
        picked = hs["experts_chosen"][:, sparse, 1] == 1
        assert picked.any()
        weights = hs["routing_weights"][:, sparse, 1][picked]
        assert (weights > 0).all()
        assert not torch.equal(hs["final"], t.hidden_states["final"])


def test_router_points_show_the_steered_routing(llms):
    """Captured with the steers: a banned expert's logit is -inf, its probability 0 and it is never chosen;
    a forced one's logit is +inf and it is always chosen; ablated, it keeps its place with weight 0."""
    prompt = random_prompts([9], seed=57)[0]
    steers = [Steer(layers=[0], point="router_logits", op="ban", experts=[1]),
              Steer(layers=[0], point="router_logits", op="force", experts=[2]),
              Steer(layers=[0], point="routing_weights", op="ablate", experts=[2])]
    spec = HiddenStatesSpec(layers=[0], points=ROUTER_POINTS, positions="all")
    hs = llms("olmoe").generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                         steering=steers, hidden_states=spec),
                                use_tqdm=False)[0].hidden_states
    assert hs["router_logits"].shape == (11, 1, 4)
    assert (hs["router_logits"][:, 0, 1] == float("-inf")).all() and (hs["router_probs"][:, 0, 1] == 0).all()
    assert (hs["experts_chosen"][:, 0, 1] == 0).all() and (hs["experts_chosen"][:, 0, 2] == 1).all()
    assert (hs["router_logits"][:, 0, 2] == float("inf")).all() and torch.isfinite(hs["router_probs"]).all()
    assert (hs["routing_weights"][:, 0, 2] == 0).all() and (hs["routing_weights"][:, 0].sum(-1) > 0).all()


def test_a_batch_mixing_a_ban_a_plain_and_a_residual_steer_equals_each_alone(moe):
    folder, _ = moe["qwen3_moe"]
    llm = LLM(folder, dtype="float32")
    solo = LLM(folder, dtype="float32", enable_prefix_caching=False)
    prompts = random_prompts([9, 14, 5], seed=55)
    g = torch.Generator().manual_seed(55)
    ban = [Steer(layers=[0, 2], point="router_logits", op="ban", experts=[1])]
    resid = [Steer(layers=[1], point="resid_post", vector=3.0 * torch.randn(HIDDEN, generator=g))]
    spec = HiddenStatesSpec(layers="all", points=["final", "experts_chosen"], positions="all")
    params = [SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=s, hidden_states=spec)
              for s in (ban, None, resid)]
    together = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, p in zip(together, prompts, params):
        alone = solo.generate([prompt], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        for point in ("final", "experts_chosen"):
            assert torch.allclose(out.hidden_states[point], alone.hidden_states[point], atol=1e-5), point
    banned = together[0].hidden_states["experts_chosen"]
    assert (banned[:, [0, 2], 1] == 0).all()
    assert (together[1].hidden_states["experts_chosen"][:, [0, 2], 1] == 1).any()  # the plain one uses it


def test_a_ban_never_reads_cached_blocks_computed_without_it(moe):
    """The same prompt with and without a ban at block 0 (which changes the KV of every later block) shares
    no cached block; each reuses its own; a ban of generated positions only leaves the prompt's blocks
    shared."""
    folder, _ = moe["mixtral"]
    llm = LLM(folder, dtype="float32", block_size=4)
    solo = LLM(folder, dtype="float32", block_size=4, enable_prefix_caching=False)
    prompt = random_prompts([13], seed=56)[0]

    def params(experts: list[int] | None, positions: str = "all") -> SamplingParams:
        steers = [Steer(layers=[0], point="router_logits", op="ban", experts=experts, positions=positions)
                  ] if experts else None
        return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, steering=steers)

    def run(p: SamplingParams, cached: int) -> None:
        out = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.metrics["num_cached_tokens"] == cached
        assert out.outputs[0].token_ids == solo.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids

    run(params(None), 0)
    run(params([0]), 0)  # not the plain run's blocks
    run(params(None), 12)  # the plain run's own
    run(params([0]), 12)  # the same ban: its own
    run(params([1]), 0)  # another expert banned: none
    run(params([2], "generated"), 12)  # the prompt is not steered: its blocks are the plain run's


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(point="resid_post", op="ban", experts=[0]), "steering.op='ban' applies at point 'router_logits' only"),
    (dict(point="router_logits", op="force"), "steering.experts is required for op='force'"),
    (dict(point="router_logits", op="ban", experts=[0], vector=[1.0] * 4), "steering.vector is not used by op='ban'"),
    (dict(point="routing_weights", op="add", vector=[1.0] * 4), "op='add' is not valid at 'routing_weights'"),
    (dict(point="mlp_out", op="scale", experts=[1]), "steering.experts applies at 'router_logits'"),
    (dict(point="router_logits", op="add", experts=[1], vector=[1.0] * 4),
     "steering.experts at 'router_logits' is for"),
    (dict(point="router_probs", op="scale"), "unknown point 'router_probs'"),
    (dict(point="router_logits", op="ban", experts=[1, 1]), "steering.experts must be a non-empty list"),
])
def test_a_steer_is_checked_where_it_is_made(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Steer(layers=[0], **kwargs)


@pytest.mark.parametrize("steers, message", [
    ([Steer(layers=[0], point="router_logits", op="ban", experts=[4])],
     r"steering\[0\]\.experts: expert 4 is out of range for 4 experts"),
    ([Steer(layers=[1], point="router_logits", op="ban", experts=[0])],
     r"steering\[0\]\.layers: block 1 has a dense MLP, no router"),
    ([Steer(layers=[0], point="router_logits", op="force", experts=[0, 1, 2])],
     r"steering\[0\]\.experts: 3 experts forced at block 0, more than the 2"),
    ([Steer(layers=[0], point="router_logits", op="ban", experts=[0, 1]),
      Steer(layers=[0, 2], point="router_logits", op="ban", experts=[3])],
     r"steering\[1\]\.experts: 3 of 4 experts banned at block 0; at least top_k=2 must stay"),
    ([Steer(layers=[2], point="router_logits", op="ban", experts=[1]),
      Steer(layers=[2], point="router_logits", op="force", experts=[-3])],
     r"steering\[1\]\.experts: expert 1 is both banned and forced at block 2"),
    ([Steer(layers=[0], point="router_logits", op="add", vector=torch.ones(5))],
     r"steering\[0\]\.vector has shape \(5,\); this point takes \[4\]"),
])
def test_a_routing_steer_is_checked_against_the_model(steers, message, llms):
    """Qwen2-MoE: 4 experts, top-2, block 1 dense."""
    with pytest.raises(ValueError, match=message):
        llms("qwen2_moe").generate([[5, 6, 7]], SamplingParams(max_tokens=2, steering=steers), use_tqdm=False)


def test_a_dense_model_has_no_router_to_steer(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    for steer in (Steer(layers=[0], point="router_logits", op="ban", experts=[0]),
                  Steer(layers=[0], point="routing_weights", op="ablate", experts=[0])):
        with pytest.raises(ValueError, match=f"does not expose '{steer.point}' \\(it has no router\\)"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, steering=[steer]), use_tqdm=False)


def test_the_prefix_cache_salt_covers_the_experts_and_the_op():
    def digest(**kw) -> bytes:
        return Steer(layers=[0], point="router_logits", **kw).digest()
    salts = {digest(op="ban", experts=[1]), digest(op="ban", experts=[2]), digest(op="force", experts=[1]),
             Steer(layers=[0], point="routing_weights", op="ablate", experts=[1]).digest(),
             Steer(layers=[0], point="routing_weights", op="scale", experts=[1], scale=0.5).digest(),
             Steer(layers=[1], point="router_logits", op="ban", experts=[1]).digest()}
    assert len(salts) == 6
    assert digest(op="ban", experts=[1]) == digest(op="ban", experts=[1])


def test_the_server_steering_extension_takes_experts():
    """The ``steering`` extension's entries carry ``experts`` to the engine's ``Steer`` (and its checks)."""
    from tapllm.server.schema import SteerRequest

    steer = SteerRequest(layers=[0], point="router_logits", op="ban", experts=[2]).to_steer()
    assert (steer.point, steer.op, steer.experts, steer.layers) == ("router_logits", "ban", [2], [0])
    with pytest.raises(ValueError, match="steering.experts is required for op='force'"):
        SteerRequest(layers=[0], point="router_logits", op="force").to_steer()
