"""One parity harness for every model family: tokens, logprobs, every point and steering vs transformers.

A family describes where its transformers model keeps what the harness hooks (an
:class:`HFLayout`); the harness then checks, in fp32:

* greedy tokens identical and chosen-token logprobs within 1e-4 of transformers, (a) each
  prompt alone, (b) batched, (c) chunked prefill with a tiny budget, (d) after a prefix-cache
  hit, (e) through preemption;
* every point of every block within 1e-4 of the state's scale, from forward hooks
  (``resid_pre`` = a block's input, ``attn_out``/``mlp_out`` = what the sublayers add to the
  residual stream, after any post-sublayer norm, ``resid_mid`` = ``resid_pre + attn_out``
  as TransformerLens defines it, ``resid_post`` = a block's output, ``embed`` =
  ``output_hidden_states[0]``, ``final`` = the final norm's output);
* the points inside attention and the MLP: ``k``/``v`` equal transformers' KV cache,
  ``attn_pattern`` its ``output_attentions`` (eager attention), ``z`` the output projection's
  input, ``mlp_post`` the down projection's input, and ``q`` reproduces the pattern with
  the captured keys (transformers keeps no post-rotary queries);
* steering at every point kind (an add and an ablate) equals hooks doing the same
  operation at the same place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conftest import assert_matches_reference, hf_greedy, random_prompts
from helpers import SteeringHooks
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.hidden_states import HIDDEN_POINTS as POINTS


@dataclass
class HFLayout:
    """Where a transformers model keeps its blocks and the modules whose outputs are the points."""

    blocks: Callable[[nn.Module], Sequence[nn.Module]]
    attn_out: Callable[[nn.Module], nn.Module]  # block -> module whose output is what attention adds
    mlp_out: Callable[[nn.Module], nn.Module]  # block -> module whose output is what the MLP adds
    final_norm: Callable[[nn.Module], nn.Module]
    skip_steer: set[tuple[str, str]] = field(default_factory=set)  # (point, op) the family cannot express


def _first(o: Any) -> torch.Tensor:
    return o[0] if isinstance(o, tuple) else o


def _block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def hf_points(model: nn.Module, layout: HFLayout, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Every point ``[positions, layers, hidden]`` of one sequence, from forward hooks."""
    blocks = layout.blocks(model)
    got: dict[str, list[torch.Tensor]] = {"resid_pre": [], "attn_out": [], "mlp_out": [], "resid_post": []}
    handles = []
    for block in blocks:
        handles.append(block.register_forward_pre_hook(
            lambda m, a, k: got["resid_pre"].append(_block_input(a, k)[0].clone()), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda m, i, o: got["resid_post"].append(_first(o)[0].clone())))
        handles.append(layout.attn_out(block).register_forward_hook(
            lambda m, i, o: got["attn_out"].append(_first(o)[0].clone())))
        handles.append(layout.mlp_out(block).register_forward_hook(
            lambda m, i, o: got["mlp_out"].append(_first(o)[0].clone())))
    final: list[torch.Tensor] = []
    handles.append(layout.final_norm(model).register_forward_hook(lambda m, i, o: final.append(_first(o)[0])))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    stack = {k: torch.stack(v, 1) for k, v in got.items()}
    stack["resid_mid"] = stack["resid_pre"] + stack["attn_out"]
    stack["embed"] = out.hidden_states[0][0][:, None]
    stack["final"] = final[0][:, None]
    return {k: v.cpu() for k, v in stack.items()}  # the model may run on a GPU


def assert_close_states(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    """Within ``tol`` of the state's scale (largest magnitude, at least 1), per layer."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    for li in range(ref.shape[1]):
        scale = max(1.0, float(ref[:, li].abs().max()))
        err = float((got[:, li] - ref[:, li]).abs().max())
        assert err <= tol * scale, f"{what} layer {li}: max error {err:.3g} at scale {scale:.3g}"


_ATTN_O = ("self_attn.o_proj", "attn.c_proj", "attention.dense")
_MLP_DOWN = ("mlp.down_proj", "mlp.c_proj", "mlp.dense_4h_to_h")


def check_logits(llm: LLM, model: nn.Module, prompts: list[list[int]], new: int, tol: float = 1e-5) -> None:
    """The logits at every position of each prompt and its ``new`` greedy tokens (the head over the captured
    ``final`` states) within ``tol`` of ``model``'s forward over the same tokens."""
    spec = HiddenStatesSpec(points=["final"], positions="all")
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, hidden_states=spec),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        seq = (prompt + out.outputs[0].token_ids)[:-1]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([seq])).logits[0]
            got = llm.engine.runner.model.compute_logits(out.hidden_states["final"][:, 0])
        assert_close_states(got[:, None], want[:, None], f"logits (prompt {len(prompt)} tokens)", tol)


def _submodule(block: nn.Module, names: tuple[str, ...]) -> nn.Module:
    found = dict(block.named_modules())
    return next(found[n] for n in names if n in found)


def hf_head_points(model: nn.Module, layout: HFLayout, token_ids: list[int], mlp_post: bool = True
                   ) -> dict[str, torch.Tensor]:
    """k, v (the KV cache), attn_pattern (eager ``output_attentions``), z and mlp_post (hooks): per layer lists."""
    blocks = layout.blocks(model)
    got: dict[str, list[torch.Tensor]] = {"z": [], "mlp_post": []}
    handles = []
    for block in blocks:
        handles.append(_submodule(block, _ATTN_O).register_forward_pre_hook(
            lambda m, a: got["z"].append(a[0][0].clone())))
        if mlp_post:
            handles.append(_submodule(block, _MLP_DOWN).register_forward_pre_hook(
                lambda m, a: got["mlp_post"].append(a[0][0].clone())))
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([token_ids]), output_attentions=True, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
        for h in handles:
            h.remove()
    layers = out.cache.layers
    found = {"k": [layer.keys[0].transpose(0, 1) for layer in layers],  # [T', Hkv, D] (T' < T past a window)
             "v": [layer.values[0].transpose(0, 1) for layer in layers],
             "attn_pattern": [a[0].transpose(0, 1) for a in out.attentions],  # [T, H, T]
             "z": got["z"], "mlp_post": got["mlp_post"]}
    return {k: [t.cpu() for t in v] for k, v in found.items()}  # the model may run on a GPU


def check_head_points(llm: LLM, model: nn.Module, layout: HFLayout, prompts: list[list[int]], new: int,
                      mlp_post: bool = True) -> None:
    """q, k, v, z, attn_pattern and (``mlp_post``: a dense model's) mlp_post of every block and position
    equal transformers'."""
    from tapllm.models.base import Attention

    inside = ["q", "k", "v", "z", "attn_pattern"] + (["mlp_post"] if mlp_post else [])
    spec = HiddenStatesSpec(layers="all", points=inside, positions="all")
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, hidden_states=spec),
                        use_tqdm=False)
    opts = [next(m for m in layer.modules() if isinstance(m, Attention)).opts
            for layer in llm.engine.runner.model.layers]
    for prompt, out in zip(prompts, outs):
        seq = (prompt + out.outputs[0].token_ids)[:-1]
        n = len(seq)
        hs = out.hidden_states
        ref = hf_head_points(model, layout, seq, mlp_post)
        what = f"(prompt {len(prompt)} tokens)"
        for i in range(len(opts)):
            for point in ("k", "v"):
                tail = ref[point][i]
                assert_close_states(hs[point][-len(tail):, i].flatten(1)[:, None], tail.flatten(1)[:, None],
                                    f"{point} block {i} {what}")
            for point in ("z", "mlp_post") if mlp_post else ("z",):
                assert_close_states(hs[point][:, i].flatten(1)[:, None], ref[point][i].flatten(1)[:, None],
                                    f"{point} block {i} {what}")
            pattern = hs["attn_pattern"][:, i]
            assert pattern.shape == (n, ref["attn_pattern"][i].shape[1], n)
            assert float((pattern - ref["attn_pattern"][i]).abs().max()) < 1e-4, f"attn_pattern block {i} {what}"
            # q: with the captured keys it gives transformers' pattern back
            from tapllm.layers.attention import attention_probs

            keys = hs["k"][:, i].transpose(0, 1)  # [Hkv, T, D]
            again = attention_probs(hs["q"][:, i], keys, 0, opts[i])
            assert float((again - ref["attn_pattern"][i]).abs().max()) < 1e-4, f"q block {i} {what}"


def check_points(llm: LLM, model: nn.Module, layout: HFLayout, prompts: list[list[int]], new: int,
                 tol: float = 1e-4, mlp_post: bool = True) -> None:
    """Every point at every block and position of a batched generate equals the hooks' (the residual-width
    ones within ``tol`` of their scale); ``mlp_post=False`` for a model without it (mixtures of experts)."""
    spec = HiddenStatesSpec(layers="all", points=list(POINTS), positions="all")
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, hidden_states=spec),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.outputs[0].token_ids
        run = len(seq) - 1  # the last sampled token is never run
        hs = out.hidden_states
        assert hs.positions.tolist() == list(range(run))
        ref = hf_points(model, layout, seq[:run])
        for point in POINTS:
            assert_close_states(hs[point], ref[point], f"{point} (prompt {len(prompt)} tokens)", tol)
    check_head_points(llm, model, layout, prompts, new, mlp_post)


def check_situations(folder, model: nn.Module, prompts: list[list[int]], new: int, **engine: Any) -> list[LLM]:
    """Greedy tokens and logprobs equal transformers alone, batched, chunked, after a cache hit, preempted;
    returns the engines it made (for a caller's checks of how their steps ran).

    ``engine``: options every ``LLM`` made here gets (the backend, graph sizes); each situation's own
    options (the chunk budget, the cache's size) override them.
    """
    refs = [hf_greedy(model, p, new) for p in prompts]
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(folder, **{"dtype": "float32", **engine})
    for p, ref in zip(prompts, refs):  # (a) alone
        assert_matches_reference(llm.generate([p], params, use_tqdm=False), [ref])
    others = random_prompts([4, 9, 15], seed=77)
    outs = llm.generate(others[:2] + prompts + others[2:], params, use_tqdm=False)  # (b) batched with others
    assert_matches_reference(outs[2:2 + len(prompts)], refs)
    chunked = LLM(folder, **{"dtype": "float32", **engine, "max_num_batched_tokens": 5,
                            "enable_prefix_caching": False})
    assert_matches_reference(chunked.generate(prompts, params, use_tqdm=False), refs)  # (c) chunked
    cached = LLM(folder, **{"dtype": "float32", **engine, "block_size": 4})
    cached.generate(prompts, params, use_tqdm=False)
    hits = cached.generate(prompts, params, use_tqdm=False)  # (d) prefix-cache hits
    assert any(o.metrics["num_cached_tokens"] > 0 for o in hits)
    assert_matches_reference(hits, refs)
    # (e) preemption: the cache holds every prompt at once, so growing while decoding must preempt.
    batch = prompts + others
    blocks = sum(-(-len(p) // 4) for p in batch)
    tight = LLM(folder, **{"dtype": "float32", **engine, "block_size": 4, "kv_cache_blocks": blocks,
                          "enable_prefix_caching": False})
    assert_matches_reference(tight.generate(batch, params, use_tqdm=False)[: len(prompts)], refs)
    assert tight.engine.scheduler.num_preemptions > 0
    return [llm, chunked, cached, tight]


class HFSteering(SteeringHooks):
    """Hooks on a transformers model doing a list of steers at the same places as tapllm.

    ``resid_mid`` is steered through the attention output: with the block input x (after any
    ``resid_pre`` steer), the attention's contribution a becomes ``op(x + a) - x``, so the
    residual stream after attention is ``op(x + a)`` in sequential and parallel blocks alike.
    """

    def __init__(self, model: nn.Module, layout: HFLayout, steers: list[Steer], num_prompt: int) -> None:
        super().__init__(num_prompt)
        blocks = layout.blocks(model)
        n = len(blocks)
        inputs: dict[int, torch.Tensor] = {}
        for s in steers:
            for layer in s.layers:
                idx = layer % n
                block = blocks[idx]
                fn = self._op(s, s.vector_for(layer))
                if s.point == "resid_pre":
                    def pre(m, a, k, fn=fn):
                        if a:
                            return (fn(a[0]),) + tuple(a[1:]), k
                        return a, {**k, "hidden_states": fn(k["hidden_states"])}
                    self.handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
                elif s.point == "resid_post":
                    self.handles.append(block.register_forward_hook(lambda m, i, o, fn=fn: self._replace(o, fn)))
                elif s.point == "attn_out":
                    self.handles.append(layout.attn_out(block).register_forward_hook(
                        lambda m, i, o, fn=fn: self._replace(o, fn)))
                elif s.point == "mlp_out":
                    self.handles.append(layout.mlp_out(block).register_forward_hook(
                        lambda m, i, o, fn=fn: self._replace(o, fn)))
                else:  # resid_mid
                    self.handles.append(block.register_forward_pre_hook(
                        lambda m, a, k, idx=idx: inputs.__setitem__(idx, _block_input(a, k)), with_kwargs=True))
                    self.handles.append(layout.attn_out(block).register_forward_hook(
                        lambda m, i, o, fn=fn, idx=idx: self._replace(o, lambda a: fn(inputs[idx] + a) - inputs[idx])))

    @staticmethod
    def _replace(o: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return (fn(o[0]),) + tuple(o[1:]) if isinstance(o, tuple) else fn(o)


def hf_steered_tokens(model: nn.Module, layout: HFLayout, prompt: list[int], steers: list[Steer], new: int
                      ) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens under the steering hooks, and the final norm's output over the whole sequence."""
    hooks = HFSteering(model, layout, steers, len(prompt))
    final: list[torch.Tensor] = []
    hooks.handles.append(layout.final_norm(model).register_forward_hook(lambda m, i, o: final.append(_first(o)[0])))
    try:
        ids, cache, tokens = torch.tensor([prompt]), None, []
        with torch.no_grad():
            for _ in range(new):
                out = model(input_ids=ids, cache=cache, use_cache=True)
                cache = out.cache
                tokens.append(int(out.logits[0, -1].argmax()))
                hooks.start += ids.shape[1]
                ids = torch.tensor([[tokens[-1]]])
            hooks.start = 0
            final.clear()
            model(input_ids=torch.tensor([(prompt + tokens)[:-1]]))
    finally:
        hooks.remove()
    return tokens, final[0]


def steering_cases(hidden: int, num_layers: int, skip: set[tuple[str, str]]) -> list[list[Steer]]:
    """One add and one ablate per point kind, each on a middle block, prompt or all positions."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for point in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
        for op, positions in (("add", "all"), ("ablate", "prompt")):
            if (point, op) in skip:
                continue
            v = torch.randn(hidden, generator=g)
            v = v * (6.0 / v.norm())
            cases.append([Steer(layers=[num_layers // 2], point=point, op=op, vector=v, scale=2.0,
                                positions=positions)])
    return cases


def check_steering(folder, model: nn.Module, layout: HFLayout, new: int = 6, **engine: Any) -> LLM:
    """Each steering case: tokens and final states equal the hooks'; the steer changes something.
    ``engine``: options of the ``LLM`` (as :func:`check_situations` takes them); returns that ``LLM``."""
    llm = LLM(folder, **{"dtype": "float32", **engine})
    cfg = llm.engine.model_config
    prompt = random_prompts([11], seed=21)[0]
    spec = HiddenStatesSpec(points=["final"], positions="all")
    base = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, hidden_states=spec),
                        use_tqdm=False)[0]
    for steers in steering_cases(cfg.hidden_size, cfg.num_layers, layout.skip_steer):
        out = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, steering=steers,
                                                    hidden_states=spec), use_tqdm=False)[0]
        tokens, final = hf_steered_tokens(model, layout, prompt, steers, new)
        what = f"{steers[0].point} {steers[0].op}"
        assert out.outputs[0].token_ids == tokens, what
        assert_close_states(out.hidden_states["final"], final[:, None], what)
        n = min(len(base.hidden_states.positions), len(out.hidden_states.positions))
        assert not torch.allclose(out.hidden_states["final"][:n], base.hidden_states["final"][:n]), what
    return llm
