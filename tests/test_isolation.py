"""One request can never fail another: bad values are refused before they run, and a failure at
run time (a reducer plugin that raises, a steer that overflows the activations, a forward-pass
error) ends that request alone while the rest of its batch completes exactly as it would have.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, SamplingParams, Steer, register_reducer
from tapllm.engine import model_runner

GOOD = random_prompts([5, 9, 14, 3, 21, 8, 11, 17], seed=11)
SPEC = {"layers": [0, 2], "points": ["resid_post"], "positions": "all"}


def _good_params() -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, hidden_states=SPEC)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def solo(llm):
    """Each good prompt run alone: what it must return whatever shares its batch."""
    return [llm.generate([p], _good_params(), use_tqdm=False)[0] for p in GOOD]


def _assert_unchanged(outs, solo) -> None:
    assert len(outs) == len(solo)
    for out, ref in zip(outs, solo):
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        a, b = out.hidden_states["resid_post"], ref.hidden_states["resid_post"]
        assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))


class Exploding:
    """A reducer plugin with a bug in one of its methods."""

    where = "update"

    def start(self, num_layers, width, device):
        if self.where == "start":
            raise RuntimeError("boom in start")
        self.acc = torch.zeros(num_layers, width, device=device)

    def update(self, rows, positions):
        if self.where == "update":
            raise RuntimeError("boom in update")
        self.acc += rows.sum(0)

    def finish(self):
        if self.where == "finish":
            raise RuntimeError("boom in finish")
        return self.acc


@pytest.mark.parametrize("where", ["start", "update", "finish"])
def test_a_reducer_plugin_that_raises_fails_its_request_alone(llm, solo, where):
    register_reducer(f"exploding-{where}", type(f"Exploding{where}", (Exploding,), {"where": where}))
    bad = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                         hidden_states={**SPEC, "reduce": f"exploding-{where}"})
    prompts = GOOD[:4] + [random_prompts([12], seed=3)[0]] + GOOD[4:]
    params = [_good_params()] * 4 + [bad] + [_good_params()] * 4
    outs = llm.generate(prompts, params, use_tqdm=False)
    failed = outs.pop(4)
    assert failed.outputs[0].finish_reason == "error" and failed.error_type == "server_error"
    assert f"boom in {where}" in failed.error and failed.hidden_states is None
    _assert_unchanged(outs, solo)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks  # nothing leaked


def test_a_steer_that_overflows_the_activations_fails_its_request_alone(tiny_models, llm, solo):
    # Finite in float32, so it passes validation, but twice added the residual stream overflows: NaN logits.
    huge = Steer(layers=[0, 1], point="resid_post", vector=torch.full((64,), 2e38), scale=1.0)
    bad = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, steering=[huge])
    outs = llm.generate(GOOD[:4] + [GOOD[0]] + GOOD[4:], [_good_params()] * 4 + [bad] + [_good_params()] * 4,
                        use_tqdm=False)
    failed = outs.pop(4)
    assert failed.outputs[0].finish_reason == "error" and failed.error_type == "invalid_request_error"
    assert "non-finite" in failed.error
    _assert_unchanged(outs, solo)
    # Its NaN KV never reaches later requests that reuse its freed blocks (small cache: reuse is certain).
    small = LLM(tiny_models["llama"], dtype="float32", block_size=4, kv_cache_blocks=24, enable_prefix_caching=False)
    assert small.generate([GOOD[4]], bad, use_tqdm=False)[0].error is not None
    _assert_unchanged(small.generate(GOOD, _good_params(), use_tqdm=False), solo)


def test_a_forward_pass_error_is_isolated_to_its_request(llm, solo, monkeypatch):
    """An unexpected error inside the batched forward: the step is rerun in halves to find its owner."""
    runner = llm.engine.runner
    real = runner.launch
    poisoned = random_prompts([10], seed=99)[0]

    def launch(items):
        if any(it.request.prompt_token_ids == poisoned for it in items):
            raise RuntimeError("kernel failure")
        return real(items)

    monkeypatch.setattr(runner, "launch", launch)
    outs = llm.generate(GOOD[:3] + [poisoned] + GOOD[3:], _good_params(), use_tqdm=False)
    failed = outs.pop(3)
    assert failed.outputs[0].finish_reason == "error" and "kernel failure" in failed.error
    _assert_unchanged(outs, solo)


def test_a_step_that_fails_before_its_upload_is_isolated_to_its_request(llm, solo, monkeypatch):
    """Laying a step out counts its requests' block-table rows as sent; when the step fails before its
    upload carried them, the halves it is rerun in must send them again (else they read stale tables)."""
    poisoned = random_prompts([10], seed=99)[0]
    real = model_runner.upload

    def upload(lay, *args, **kwargs):
        if any(it.request.prompt_token_ids == poisoned for it in lay.items):
            raise RuntimeError("staging failure")
        return real(lay, *args, **kwargs)

    monkeypatch.setattr(model_runner, "upload", upload)
    outs = llm.generate(GOOD[:3] + [poisoned] + GOOD[3:], _good_params(), use_tqdm=False)
    failed = outs.pop(3)
    assert failed.outputs[0].finish_reason == "error" and "staging failure" in failed.error
    _assert_unchanged(outs, solo)


BAD_VALUES = [
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=1e-300), "top_p"),
    (dict(seed=2**64), "seed"),
    (dict(steering=[Steer(layers=[0], vector=torch.full((64,), 1e30), scale=1e10)]), "overflows"),
    (dict(logprobs=49153), "max_logprobs=20"),
    (dict(logprobs=10**9), "max_logprobs=20"),
]


@pytest.mark.parametrize("kwargs, message", BAD_VALUES)
def test_bad_values_are_refused_and_the_good_requests_are_unharmed(llm, solo, kwargs, message):
    engine = llm.engine
    # Offline: generate refuses the whole call up front, naming the prompt and field; nothing ran.
    with pytest.raises(ValueError, match=message):
        params = SamplingParams(**{"max_tokens": 6, "temperature": 1.0, **kwargs})
        llm.generate(GOOD + [GOOD[0]], [_good_params()] * len(GOOD) + [params], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    # As a server does it: the good requests are in flight when the bad one arrives and is refused.
    prepared = [engine.input_processor.prepare(p, _good_params()) for p in GOOD]
    reqs = [engine.add(p) for p in prepared[:4]]
    engine.step()
    with pytest.raises(ValueError, match=message):
        params = SamplingParams(**{"max_tokens": 6, "temperature": 1.0, **kwargs})
        engine.input_processor.prepare(GOOD[0], params)
    reqs += [engine.add(p) for p in prepared[4:]]
    while engine.has_unfinished_requests():
        engine.step()
    _assert_unchanged([engine.make_output(r) for r in reqs], solo)


def test_a_tiny_temperature_is_greedy(llm):
    prompt = GOOD[2]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    tiny = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1e-45, ignore_eos=True), use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_tiny_top_p_samples_the_most_likely_token(llm):
    prompt = GOOD[1]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-40, seed=3, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_logprobs_up_to_the_limit_and_the_limit_is_configurable(tiny_models, llm):
    out = llm.generate([GOOD[0]], SamplingParams(max_tokens=2, temperature=0, logprobs=20), use_tqdm=False)[0]
    assert all(len(entry) >= 20 for entry in out.outputs[0].logprobs)
    wide = LLM(tiny_models["llama"], dtype="float32", max_logprobs=49152)
    out = wide.generate([GOOD[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=49152), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == 49152


def test_a_failed_step_leaves_a_seeded_request_s_draws_unchanged(llm, monkeypatch):
    """A step that fails in its forward pass had already drawn its seeded rows' uniforms; when it is
    rerun (in halves), each seeded request must draw the same uniform again, not its next one."""
    seeded = SamplingParams(max_tokens=8, temperature=5.0, seed=7, ignore_eos=True)
    want = llm.generate([GOOD[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    poison = 17  # in no GOOD prompt (their ids are 100 and above)
    model = llm.engine.runner.model
    real = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == poison).any()):
            raise RuntimeError("kernel failure")
        return real(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    bad, good = llm.generate([[poison] + GOOD[0], GOOD[1]], [_good_params(), seeded], use_tqdm=False)
    assert bad.error is not None and "kernel failure" in bad.error
    assert good.error is None and good.outputs[0].token_ids == want
