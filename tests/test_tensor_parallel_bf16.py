"""Tensor parallelism in bfloat16: TP 2 against one process, within bfloat16's rounding.

In float32 the ranks agree with one process within 1e-5 (tests/test_tensor_parallel.py). In bfloat16
they cannot agree bit for bit: a row-parallel layer (o_proj, down_proj) rounds each rank's partial
sum to bfloat16 and the all-reduce rounds their sum again, where one process rounds one full sum
once: about two roundings (u = eps / 2 = 2^-8 each) of the partial sums per layer, two such layers a
block, so 3 blocks give some 12 u = 6 eps at most before amplification. Attention amplifies: q and k
that differ by r (relative) move the scores by about 2 r |score|, and softmax turns that into
relative changes of the weights, so z and what follows it may differ by several eps (measured on
these tiny models: residual-stream points 2-4 eps, z up to 6.2 eps, of each point's largest magnitude).
``TOL`` is 16 eps = 2^-3 of each point's scale (``assert_close``: its largest magnitude, at least
1): 2.5x the largest difference seen, and still an order of magnitude under what a real error gives
(a wrong head, a missing all-reduce, or one different input token: 90-190 eps on these models).

Greedy tokens may differ only where the one-process logits nearly tie, and in bfloat16 they often
do: the LM head's logits are bfloat16, spaced 2^-5 apart at the magnitudes of these tiny models'
(whose flat random heads give top-2 gaps of 0 to a few spacings). TP moves a logit by about one
spacing (measured <= 0.034); ``LOGIT_TOL`` = 2^-4 allows two (one where |logit| >= 8). The top-2
order cannot flip where the one-process gap exceeds ``2 * LOGIT_TOL``, so tokens are compared up to
the first position where it does not, and states at the positions whose inputs are all equal tokens
(the prompt's, always). The tiny random models' logits are flat, so only about a tenth to a fifth
of the generated positions have such a margin (in all: 22 and 24 of 120 here).
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts, save_tiny_model
from helpers import assert_close, greedy
from tapllm import LLM, HiddenStatesSpec, Steer

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7
TOL = 16 * BF16_EPS
LOGIT_TOL = 2**-4
# Of the 120 tokens generated, those with a clear margin (measured: llama 22, phi3 24): the test is not vacuous.
MIN_TOKENS_COMPARED = 8
ENGINE = dict(dtype="bfloat16", kv_cache_blocks=64, max_num_batched_tokens=32)
POINTS = ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "q", "k", "v", "z", "mlp_post", "final"]


@pytest.fixture(scope="module", params=["llama", "phi3"])
def pair(request, tmp_path_factory, default_model_folder):
    """One process and TP 2 in bfloat16 on a tiny model: Llama, and Phi-3 (fused q/k/v and gate/up)."""
    from family_configs import family_configs

    folder = save_tiny_model(tmp_path_factory.mktemp("bf16") / request.param, family_configs()[request.param],
                             default_model_folder)
    one = LLM(folder, enforce_eager=True, **ENGINE)
    two = LLM(folder, tensor_parallel_size=2, **ENGINE)
    yield request.param, one, two
    two.close()


def _trusted_tokens(logprobs: list[dict]) -> int:
    """How many leading generated tokens the one-process top-2 gap (> 2 LOGIT_TOL) makes certain."""
    for i, top in enumerate(logprobs):
        first, second = sorted((lp.logprob for lp in top.values()), reverse=True)[:2]
        if first - second <= 2 * LOGIT_TOL:
            return i
    return len(logprobs)


def _compare(a, b, points: list[str]) -> tuple[int, list[str]]:
    """Tokens and states of one request at TP 2 (``b``) against one process (``a``): how many tokens the
    margins let compare, and each point's difference in eps of its scale."""
    assert a.error is None and b.error is None, (a.error, b.error)
    ca, cb = a.outputs[0], b.outputs[0]
    trusted = _trusted_tokens(ca.logprobs)
    assert cb.token_ids[:trusted] == ca.token_ids[:trusted]
    for t, la, lb in zip(ca.token_ids[:trusted], ca.logprobs, cb.logprobs):
        assert abs(la[t].logprob - lb[t].logprob) <= 2 * LOGIT_TOL
    rows = len(a.prompt_token_ids) + trusted  # positions whose inputs are equal tokens
    measured = []
    for point in points:
        x, y = a.hidden_states[point][:rows], b.hidden_states[point][:rows]
        scale = max(1.0, float(x.float().abs().max()))
        measured.append(f"{point} {float((x.float() - y.float()).abs().max()) / scale / BF16_EPS:.2f} eps")
        assert_close(y, x, TOL)
    return trusted, measured


def test_bf16_states_and_tokens_equal_one_process_within_rounding(pair):
    name, one, two = pair
    spec = HiddenStatesSpec(layers="all", points=POINTS, positions="all")
    params = greedy(10, hidden_states=spec, logprobs=2)
    # 40 > the budget of 32: chunked prefill
    prompts = random_prompts([6, 40, 11, 23, 17, 9, 14, 30, 8, 19, 12, 26], seed=3)
    a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
    compared = 0
    for x, y in zip(a, b, strict=True):
        assert y.hidden_states[POINTS[0]].dtype == torch.bfloat16
        trusted, measured = _compare(x, y, POINTS)
        compared += trusted
        print(name, trusted, measured)
    assert compared >= MIN_TOKENS_COMPARED, f"{name}: only {compared} tokens had a clear margin"


def test_bf16_steering_at_residual_and_sharded_points(pair):
    name, one, two = pair
    hidden = one.engine.model_config.hidden_size
    head_dim = one.engine.model_config.head_dim
    g = torch.Generator().manual_seed(7)
    steers = [Steer(layers=[1], point="resid_mid", vector=torch.randn(hidden, generator=g), scale=0.5),
              Steer(layers=[0], point="z", vector=torch.randn(head_dim, generator=g), heads=[1, 2]),
              Steer(layers=[2], point="mlp_post", op="scale", scale=0.0, neurons=[3, 64, 100])]
    points = ["resid_post", "z", "mlp_post"]
    params = greedy(6, steering=steers, logprobs=2,
                    hidden_states=HiddenStatesSpec(layers="all", points=points, positions="all"))
    prompts = random_prompts([9], seed=4)
    a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
    print(name, *_compare(a[0], b[0], points))
