"""Sampling: per-request seeds independent of the batch, stop strings, stop ids, EOS, logprobs."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def test_same_seed_same_text_whatever_the_batch(llm):
    target = random_prompts([12], seed=3)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=42, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0]
    others = random_prompts([5, 30, 7, 19, 44, 2], seed=4)
    mixed_params = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in (3, 20, 9, 16, 5, 11)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate(others[:3] + [target] + others[3:], mixed_params[:3] + [params] + mixed_params[3:], use_tqdm=False)
    assert outs[3].outputs[0].token_ids == alone.token_ids
    assert outs[3].outputs[0].text == alone.text
    outs = llm.generate([target, *others[:2]], [params, greedy, greedy], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.token_ids


def test_unseeded_requests_differ_but_engine_seed_reproduces(tiny_models):
    prompt = random_prompts([6], seed=5)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    a = LLM(tiny_models["llama"], dtype="float32", seed=1).generate([prompt, prompt], params, use_tqdm=False)
    b = LLM(tiny_models["llama"], dtype="float32", seed=1).generate([prompt, prompt], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert a[0].outputs[0].token_ids != a[1].outputs[0].token_ids


def test_top_k_one_is_greedy(llm):
    prompt = random_prompts([9], seed=6)[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True), use_tqdm=False)
    tiny_p = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, ignore_eos=True), use_tqdm=False)
    assert topk1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert tiny_p[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_stop_token_ids_and_eos(llm):
    prompt = random_prompts([10], seed=8)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(ids) == 12
    stop_at = ids[5]
    first = ids.index(stop_at)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    # The same token declared as EOS ends generation unless ignore_eos.
    eos = llm.engine.model_config.eos_token_ids
    llm.engine.model_config.eos_token_ids = (stop_at,)
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ids[: first + 1] and out.outputs[0].finish_reason == "stop"
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ids
    finally:
        llm.engine.model_config.eos_token_ids = eos


def test_stop_strings_cut_the_text(llm):
    prompt = random_prompts([10], seed=9)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert len(text) > 12
    stop = text[6:9]
    expected = text[: text.index(stop)]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop, "\x00never"]), use_tqdm=False)[0]
    assert out.outputs[0].text == expected
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.outputs[0].token_ids) < 16
    # Other requests in the same call are not affected by one request's stop.
    both = llm.generate([prompt, prompt], [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop),
                                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)], use_tqdm=False)
    assert both[0].outputs[0].text == expected
    assert both[1].outputs[0].text == text and both[1].outputs[0].finish_reason == "length"


def test_incremental_detokenization_handles_split_characters(llm):
    tok = llm.tokenizer
    text = "héllo 日本語 🙂 naïve — ok"
    ids = tok.encode(text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some character spans tokens
    from tapllm.engine.tokenizer import IncrementalDetokenizer

    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(det.step(i) for i in ids) == text
    # After a prompt, the stream matches a full decode of the completion.
    prompt = tok.encode("Say:")
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    assert "".join(det.step(i) for i in ids) == tok.decode(ids)


def test_logprobs_top_n(llm):
    prompt = random_prompts([7], seed=10)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert entry[tok].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.decoded_token is not None for lp in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_max_tokens_none_generates_to_the_end_of_the_context(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    limit = llm.engine.model_config.max_model_len
    prompt = list(range(100, 100 + limit - 5))
    out = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(("logits", "top_k"), [
    (torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0, 1.5, 0.2]), 5),
    # 1000 tokens: the top-p cut inside the 256 most likely (peaked) and past them (flat)
    (torch.cat([torch.tensor([6.0, 5.5, 5.0]), torch.linspace(-4, 0, 997)]), 0),
    (torch.linspace(-0.5, 0.5, 1000), 0),
])
def test_draws_follow_the_distribution_after_temperature_top_k_top_p(logits, top_k):
    """The sampler's draw, many times from one row, matches the probabilities it should sample
    from (temperature, then top-k and top-p), and never picks an excluded token."""
    from tapllm.engine.request import Request
    from tapllm.engine.sampler import SamplingPlan
    from tapllm.engine.staging import Staging

    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=0.9)
    x = logits / 0.7
    kept = torch.topk(x, top_k or x.numel()).indices
    probs = torch.full_like(x, float("-inf")).scatter(0, kept, x[kept]).softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    probs[order[before >= 0.9]] = 0.0
    probs /= probs.sum()
    n = 20000
    staging = Staging(torch.device("cpu"))
    staging.begin()
    plan = SamplingPlan([Request(f"r{i}", 0, None, [1], params, 1000 + i) for i in range(n)], x.numel(), staging,
                        torch.device("cpu"))
    plan.bind(staging.upload())
    drawn = plan.sample(logits.expand(n, -1), None, None)[:n].long()
    counts = torch.bincount(drawn, minlength=x.numel()).double() / n
    assert counts[probs == 0].sum() == 0
    torch.testing.assert_close(counts, probs.double(), atol=0.015, rtol=0)
