"""Every tensor tapllm returns is an ordinary tensor: a probe trains on it (issue 50, item 3).

Tensors made under ``torch.inference_mode`` cannot be saved for backward ("Inference tensors
cannot be saved for backward"). Here a linear probe takes a few gradient steps on each kind of
returned tensor, fed to it as it is (no copy that would hide an inference tensor): states at every
kind of positions, reduced, projected, in bfloat16, of forked samples, from ``encode``; SAE
features; the lens; and results of an engine run inside the caller's own ``inference_mode``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, SamplingParams
from tapllm.kernels import triton_tap
from tapllm.sae.model import SAE
from tapllm.sae.sae_config import SAEConfig

HIDDEN = 64


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


@pytest.fixture(scope="module")
def llm_bf16(tiny_models):
    return LLM(tiny_models["llama"], dtype="bfloat16")


def _sae() -> SAE:
    g = torch.Generator().manual_seed(0)
    cfg = SAEConfig("topk", HIDDEN, 128, "resid_post", 1, k=8)
    return SAE(cfg, torch.randn(HIDDEN, 128, generator=g) * 0.3, torch.randn(128, generator=g) * 0.1,
               torch.randn(128, HIDDEN, generator=g) * 0.1, torch.randn(HIDDEN, generator=g) * 0.1)


def train_probe(x: torch.Tensor, steps: int = 5) -> list[float]:
    """Losses of ``steps`` gradient steps of a linear probe on the rows of ``x`` (fed as returned)."""
    assert not x.is_inference() and not x.requires_grad
    rows = x.reshape(-1, x.shape[-1])  # a view: still the returned tensor's memory and kind
    y = torch.randn(rows.shape[0], 1, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    probe = torch.nn.Linear(rows.shape[1], 1, dtype=x.dtype)
    torch.nn.init.zeros_(probe.weight)
    torch.nn.init.zeros_(probe.bias)
    with torch.no_grad():  # a step of 1/L, L the loss's smoothness: every step lowers the loss
        a = torch.cat([rows.float(), torch.ones(rows.shape[0], 1)], 1)
        lr = rows.shape[0] / (2 * float(torch.linalg.matrix_norm(a, 2)) ** 2)
    opt = torch.optim.SGD(probe.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(probe(rows), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _assert_trains(x: torch.Tensor) -> None:
    losses = train_probe(x)
    assert losses[-1] < losses[0], losses


def _generate(llm: LLM, spec: dict, n: int = 1):
    prompt = random_prompts([7], seed=3)[0]
    params = SamplingParams(max_tokens=6, temperature=0 if n == 1 else 1.0, seed=0, n=n, ignore_eos=True,
                            hidden_states=spec)
    return llm.generate([prompt], params, use_tqdm=False)[0]


@pytest.mark.parametrize("positions", ["prompt", "all", "generated", (4, 11), "last", "last_prompt"])
def test_states_at_every_kind_of_positions(llm, positions):
    hs = _generate(llm, dict(positions=positions, points=["resid_pre", "resid_post"])).hidden_states
    for point in ("resid_pre", "resid_post"):
        _assert_trains(hs[point])
    assert not hs.positions.is_inference()


@pytest.mark.parametrize("spec", [
    dict(positions="all", reduce="mean"),
    dict(positions="generated", reduce="max"),
    dict(positions="all", project=torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))),
    dict(positions="all", points=["q", "attn_out", "mlp_post"], heads=[1, 2]),
    dict(positions="all", dtype="bfloat16"),
], ids=["mean", "max", "project", "heads-and-neurons", "bf16-copy"])
def test_reduced_projected_and_converted_states(llm, spec):
    hs = _generate(llm, spec).hidden_states
    for point in hs:
        _assert_trains(hs[point])


def test_bfloat16_model_states(llm_bf16):
    hs = _generate(llm_bf16, dict(positions="all")).hidden_states
    assert hs["resid_post"].dtype == torch.bfloat16
    _assert_trains(hs["resid_post"])


def test_forked_samples_and_encode(llm):
    out = _generate(llm, dict(positions="all"), n=2)
    for c in out.outputs:
        _assert_trains(c.hidden_states["resid_post"])
    prompts = random_prompts([5, 9, 12], seed=4)
    for spec in (dict(positions="all"), dict(positions="all", reduce="mean")):  # states, and embeddings
        for enc in llm.encode(prompts, spec, use_tqdm=False):
            _assert_trains(enc.hidden_states["resid_post"])


@pytest.mark.parametrize("features", ["topk:8", "all", [3, 7, 11]])
def test_sae_features(llm, features):
    hs = _generate(llm, dict(positions="all", sae=_sae(), features=features)).hidden_states
    f = hs.features
    for t in f.tensors().values():
        assert not t.is_inference()
    _assert_trains(f.values if f.values is not None else f.dense)
    _assert_trains(f.error_norm[:, None])


@pytest.mark.parametrize("reduce", [None, "mean"])
def test_lens(llm, reduce):
    hs = _generate(llm, dict(positions="all", lens=4, lens_targets=[5, 9], reduce=reduce)).hidden_states
    r = hs.lens["resid_post"]
    assert not r.token_ids.is_inference()
    _assert_trains(r.logprobs)
    _assert_trains(r.target_logprobs)


def test_an_engine_run_inside_the_callers_inference_mode(llm):
    with torch.inference_mode():
        hs = _generate(llm, dict(positions="all", lens=2)).hidden_states
    _assert_trains(hs["resid_post"])
    _assert_trains(hs.lens["resid_post"].logprobs)


@pytest.mark.skipif(not triton_tap.available(torch.device("cpu")), reason="needs Triton's interpreter")
def test_the_graph_step_and_the_host_a_step_ahead(tiny_models):
    """The CUDA backend's graph step (here on the CPU: Triton interpreted, graphs emulated), the host a step
    ahead: requests keep views of a step's host copy of its capture buffer, and SAE features of its pack."""
    llm = LLM(tiny_models["llama"], dtype="float32", backend="cuda", max_num_seqs=4, cuda_graph_sizes=[1, 2, 4],
              cuda_graph_token_sizes=[], async_scheduling=True)
    for spec in (dict(positions="all"), dict(positions="generated", sae=_sae(), points=["resid_post"], layers=[1])):
        hs = _generate(llm, spec).hidden_states
        _assert_trains(hs["resid_post"])
        if hs.features is not None:
            _assert_trains(hs.features.values)
