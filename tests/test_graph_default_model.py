"""The graph path on the default model's real weights equals the eager path and transformers.

The CUDA backend runs on the CPU (``backend="cuda"``: its Triton kernels in Triton's interpreter, graphs
emulated), float32: plain steps, and steps tapped (every block's residual stream at every position) and
steered at once, give transformers' greedy tokens, and states within 1e-5 of their scale of transformers' and of the
eager step's. Transformers' steering is its forward hooks doing the same operation.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, greedy
from tapllm import LLM, HiddenStatesSpec, Steer
from tapllm.kernels import triton_tap

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not triton_tap.available(torch.device("cpu")),
                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1)")]

PROMPTS = ["The capital of France is"]
NEW = 3
STEER_LAYERS = [4, 17]


@pytest.fixture(scope="module")
def hf(default_model_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_folder), dtype=torch.float32).eval()


def _reference(hf, ids: list[int], steer: torch.Tensor | None) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and every block's input (``resid_pre``, recorded by pre-hooks), with
    ``steer`` added to the output of the blocks in :data:`STEER_LAYERS` (``resid_post``) when given."""
    handles, inputs = [], {}
    if steer is not None:
        for layer in STEER_LAYERS:
            handles.append(hf.model.layers[layer].register_forward_hook(
                lambda m, a, out: (out[0] + steer,) + tuple(out[1:]) if isinstance(out, tuple) else out + steer))
    for i, layer in enumerate(hf.model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0]),
            with_kwargs=True))
    try:
        with torch.no_grad():
            seq = list(ids)
            for _ in range(NEW):
                logits = hf(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            hf(torch.tensor([seq[:-1]]))
    finally:
        for h in handles:
            h.remove()
    return seq[len(ids):], [inputs[i] for i in range(len(hf.model.layers))]


def test_graph_path_on_the_default_model_equals_eager_and_transformers(default_model_folder, hf):
    graphed = LLM(default_model_folder, dtype="float32", backend="cuda", max_num_seqs=4, cuda_graph_sizes=[1, 2, 4],
                  cuda_graph_token_sizes=[16, 32, 64], max_num_batched_tokens=64)
    eager = LLM(default_model_folder, dtype="float32", enforce_eager=True)
    ids = [graphed.engine.tokenizer.encode(p) for p in PROMPTS]
    layers = graphed.engine.model_config.num_layers
    steer = torch.randn(graphed.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0)) * 2
    spec = HiddenStatesSpec(layers="all", points="resid_pre", positions="all")
    cases = {"plain": greedy(NEW),
             "tapped and steered": greedy(NEW, hidden_states=spec,
                                          steering=[Steer(layers=STEER_LAYERS, point="resid_post", vector=steer)])}
    for name, params in cases.items():
        got = graphed.generate(ids, params, use_tqdm=False)
        want = eager.generate(ids, params, use_tqdm=False)
        for prompt, g, w in zip(ids, got, want):
            tokens, states = _reference(hf, prompt, steer if "steered" in name else None)
            assert g.outputs[0].token_ids == tokens == w.outputs[0].token_ids, name
            if g.hidden_states is not None:
                ref = torch.stack(states[:layers], dim=1)  # [positions, layers, hidden]
                assert_close(g.hidden_states["resid_pre"], ref, 1e-5)
                assert_close(g.hidden_states["resid_pre"], w.hidden_states["resid_pre"], 1e-5)
    policy = graphed.engine.runner.policy
    assert policy.graph_steps > 0 and not policy.eager_steps, policy.eager_steps
