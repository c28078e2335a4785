"""vLLM's sampling controls: penalties, logit bias, bans, allowed ids, min_tokens, truncation, n and best_of."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.engine.llm_engine import sample_seed
from tapllm.engine.logits_processors import ControlledRow, LogitsControls, apply_controls, tokenize_bad_words
from tapllm.steering.spec import Steer


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


@pytest.fixture(scope="module")
def hf_model(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _tokens(out):
    return [c.token_ids for c in out.outputs]


# ---- equal to transformers' logits processors ---------------------------------------------------------------

def _hf_reference(model, prompt, steps, *, repetition=1.0, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding with transformers' processors (and the presence/frequency formula) on its logits."""
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    procs = []
    if bias:  # vLLM order: bias first, then the penalties
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]))
    if repetition != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition))
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            scores = model(input_ids=torch.tensor([ids])).logits[:, -1].float()
            for proc in procs:
                scores = proc(torch.tensor([ids]), scores)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=scores.shape[-1]).float()
            scores = scores - frequency * counts - presence * (counts > 0).float()
            token = int(scores.argmax())
            out.append(token)
            ids.append(token)
    return out


# The tiny random model never repeats a token by itself: a bias makes it want to (token 777, or
# the prompt's first token for the repetition penalty), and the penalty must then hold it back.
@pytest.mark.parametrize("controls", [
    dict(repetition=0.5),
    dict(repetition=1.8, bias="prompt"),
    dict(presence=2.0, bias=7.0),
    dict(frequency=1.0, bias=9.0),
    dict(presence=-2.0, frequency=1.0, bias=8.0),
    dict(bias="top"),
    dict(bias="top", repetition=1.4, presence=0.5, frequency=0.8),
])
def test_penalties_and_bias_equal_transformers(llm, hf_model, controls):
    # a prompt with repeats, so the repetition penalty touches prompt tokens more than once
    prompt = random_prompts([6], seed=11)[0] * 3
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    plain = _tokens(_gen(llm, [prompt], SamplingParams(**greedy))[0])[0]
    controls = dict(controls)
    bias = controls.get("bias")
    if bias == "top":  # push down the greedy choices, lift an arbitrary token
        controls["bias"] = {plain[0]: -30.0, plain[1]: -5.0, 777: 12.5}
    elif bias == "prompt":
        controls["bias"] = {prompt[0]: 8.0}
    elif bias is not None:
        controls["bias"] = {777: bias}
    ref = _hf_reference(hf_model, prompt, 12, **controls)
    params = SamplingParams(repetition_penalty=controls.get("repetition", 1.0),
                            presence_penalty=controls.get("presence", 0.0),
                            frequency_penalty=controls.get("frequency", 0.0), logit_bias=controls.get("bias"),
                            **greedy)
    got = _tokens(_gen(llm, [prompt], params)[0])[0]
    assert got == ref
    # the controls really acted: the penalties changed what the bias alone (or plain greedy) gives
    if bias is None or bias == "top" and len(controls) == 1:
        assert got != plain
    else:
        assert got != _tokens(_gen(llm, [prompt], SamplingParams(logit_bias=controls["bias"], **greedy))[0])[0]


def test_logit_bias_is_clamped_and_keys_may_be_strings():
    p = SamplingParams(logit_bias={"5": 500, 7: -1e9, "9": 0.25})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.25}


# ---- bans, allowed ids, min_tokens, truncation ---------------------------------------------------------------

def test_allowed_token_ids_restrict_every_token(llm):
    prompt = random_prompts([8], seed=12)[0]
    allowed = [101, 2024, 3000, 40000]
    for temperature in (0, 1.0):
        out = _gen(llm, [prompt], SamplingParams(max_tokens=10, temperature=temperature, seed=3, ignore_eos=True,
                                                 allowed_token_ids=allowed))[0]
        assert set(out.outputs[0].token_ids) <= set(allowed)


def test_a_bad_word_is_banned_from_the_output(llm):
    tok = llm.tokenizer
    prompt = random_prompts([8], seed=13)[0]
    plain = _gen(llm, [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    # the first generated token that is a word of its own: its text tokenizes back to it
    at, word = next((i, tok.decode([t])) for i, t in enumerate(plain) if tok.decode([t]).strip()
                    and [t] in tokenize_bad_words(tok, [tok.decode([t])]))
    out = _gen(llm, [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word]))[0]
    ids = out.outputs[0].token_ids
    assert plain[at] not in ids and ids[:at] == plain[:at]


def test_a_longer_bad_word_bans_its_last_token_after_the_rest_of_it_in_the_output():
    controls = LogitsControls(bad_sequences=(((5, 6), 7),))
    cases = [([5, 6], [], False),  # the prefix is in the prompt only: vLLM matches the output
             ([1], [5, 6], True), ([1], [5], False), ([1], [6, 5], False), ([5], [6], False)]
    for prompt, output, banned in cases:
        x = torch.zeros(1, 10)
        apply_controls(x, [ControlledRow(controls, -1, prompt + output, len(prompt))], None)
        assert (x[0, 7] == float("-inf")) == banned, (prompt, output)
        assert bool(torch.isfinite(x[0, :7]).all())


def test_min_tokens_holds_back_stop_tokens(llm):
    prompt = random_prompts([10], seed=8)[0]
    free = _gen(llm, [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    stop = free[2]
    early = _gen(llm, [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop],
                                               ignore_eos=True))[0].outputs[0]
    assert len(early.token_ids) == free.index(stop) + 1 and early.finish_reason == "stop"
    held = _gen(llm, [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop], min_tokens=6,
                                              ignore_eos=True))
    ids = held[0].outputs[0].token_ids
    assert len(ids) >= 6 and stop not in ids[:6]
    if held[0].outputs[0].finish_reason == "stop":
        assert ids[-1] == stop


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = random_prompts([30], seed=14)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cut = _gen(llm, [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=9))
    assert cut[0].prompt_token_ids == prompt[-9:]
    assert _tokens(cut[0]) == _tokens(_gen(llm, [prompt[-9:]], params)[0])


# ---- n and best_of ----------------------------------------------------------------------------------------------

def test_seeded_n_is_reproducible_independent_of_the_batch_and_each_sample_is_its_own_seed(llm):
    prompt = random_prompts([21], seed=15)[0]
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    alone = _gen(llm, [prompt], params)[0]
    assert len(alone.outputs) == 4 and [c.index for c in alone.outputs] == [0, 1, 2, 3]
    assert len({tuple(t) for t in _tokens(alone)}) > 1
    others = random_prompts([5, 40, 9], seed=16)
    mixed = _gen(llm, [others[0], prompt, *others[1:]],
                 [SamplingParams(max_tokens=7, temperature=0.8, n=2), params,
                  SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=12, temperature=1.0)])
    assert _tokens(mixed[1]) == _tokens(alone)
    assert _tokens(_gen(llm, [prompt], params)[0]) == _tokens(alone)
    # sample i is exactly an n=1 request seeded sample_seed(7, i): the shared KV is the KV it would compute
    for i, c in enumerate(alone.outputs):
        single = _gen(llm, [prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=sample_seed(7, i),
                                                    ignore_eos=True))[0]
        assert single.outputs[0].token_ids == c.token_ids


def test_n_samples_share_the_prompt_blocks_and_copy_the_last_on_write(llm):
    engine = llm.engine
    bs = engine.blocks.block_size
    prompt = random_prompts([2 * bs + 5], seed=17)[0]  # two full blocks and a partial one
    free0 = engine.blocks.num_free_blocks
    req = engine.add(engine.input_processor.prepare(prompt, SamplingParams(n=4, max_tokens=6, temperature=0.7, seed=1,
                                                                            ignore_eos=True)))
    engine.step()  # the prompt runs once; four first tokens are drawn and the samples fork
    group = req.group
    assert len(group) == 4 and all(s.num_computed_tokens == len(prompt) for s in group)
    shared = req.block_table[:3]
    assert all(s.block_table[:3] == shared for s in group)
    assert [engine.blocks.ref_counts[b] for b in shared] == [4, 4, 4]
    assert free0 - engine.blocks.num_free_blocks == 3  # separate requests would hold 12
    engine.step()  # each sample writes its first token into the partial block: three copy it, one keeps it
    partial = [s.block_table[2] for s in group]
    assert len(set(partial)) == 4 and shared[2] in partial
    assert [engine.blocks.ref_counts[b] for b in shared[:2]] == [4, 4]
    assert free0 - engine.blocks.num_free_blocks == 2 + 4
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.make_output(req)
    assert sum(engine.blocks.ref_counts) == 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    expect = _gen(llm, [prompt], SamplingParams(n=4, max_tokens=6, temperature=0.7, seed=1, ignore_eos=True))[0]
    assert _tokens(out) == _tokens(expect)


def test_greedy_n_equals_n1_and_best_of_keeps_the_highest_cumulative_logprob(llm):
    prompt = random_prompts([19], seed=18)[0]
    one = _gen(llm, [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    many = _gen(llm, [prompt], SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert _tokens(many) == _tokens(one) * 3
    four = _gen(llm, [prompt], SamplingParams(n=4, max_tokens=8, temperature=1.2, seed=5, logprobs=0,
                                              ignore_eos=True))[0]
    best = _gen(llm, [prompt], SamplingParams(n=2, best_of=4, max_tokens=8, temperature=1.2, seed=5,
                                              ignore_eos=True))[0]
    ranked = sorted(four.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]
    for b, r in zip(best.outputs, ranked):
        assert b.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
        assert r.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(r.logprobs, r.token_ids)),
                                                     abs=1e-4)


def test_hidden_states_and_steering_per_sample(llm):
    prompt = random_prompts([13], seed=19)[0]
    hidden = llm.engine.model_config.hidden_size
    steer = Steer(layers=[1], point="resid_post", op="add", vector=torch.randn(hidden, generator=torch.Generator()
                                                                                .manual_seed(0)), scale=4.0)
    for spec in (HiddenStatesSpec(layers=[0, -1], points=["resid_post", "attn_out"], positions="all"),
                 HiddenStatesSpec(layers="all", positions="all", reduce="mean")):
        kw = dict(max_tokens=7, temperature=1.0, ignore_eos=True, hidden_states=spec, steering=[steer])
        out = _gen(llm, [prompt], SamplingParams(n=3, seed=9, **kw))[0]
        assert out.hidden_states is out.outputs[0].hidden_states
        for i, c in enumerate(out.outputs):
            single = _gen(llm, [prompt], SamplingParams(seed=sample_seed(9, i), **kw))[0]
            assert c.token_ids == single.outputs[0].token_ids
            for point in c.hidden_states.points:
                torch.testing.assert_close(c.hidden_states[point], single.hidden_states[point], rtol=1e-5, atol=1e-5)
        if spec.reduce is None:  # the prompt rows were captured once: every sample holds the same
            p = len(prompt)
            for c in out.outputs[1:]:
                assert torch.equal(c.hidden_states["resid_post"][:p], out.outputs[0].hidden_states["resid_post"][:p])


# ---- validation and isolation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(logit_bias={3: float("inf")}), "logit_bias[3] must be a finite number"),
    (dict(logit_bias={"x": 1.0}), "logit_bias: key 'x' is not a token id"),
    (dict(min_tokens=20, max_tokens=5), "min_tokens (20) must be <= max_tokens (5)"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(bad_words=[""]), "bad_words[0] must be a non-empty string"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(n=3, best_of=2), "best_of must be an integer >= n (3)"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be an integer >= 1"),
])
def test_bad_values_name_the_field_and_limit(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_vocabulary_checks_at_admission(llm):
    vocab = llm.engine.model_config.vocab_size
    prompt = [5, 6, 7]
    for kwargs, message in [
        (dict(logit_bias={vocab: 1.0}), f"logit_bias: token id {vocab} is outside the vocabulary [0, {vocab})"),
        (dict(allowed_token_ids=[1, vocab + 3]), f"allowed_token_ids: token id {vocab + 3} is outside"),
        (dict(n=1000), "n: 1000 samples of one prompt, more than max_num_seqs=128"),
    ]:
        with pytest.raises(ValueError) as err:
            _gen(llm, [prompt], SamplingParams(**kwargs))
        assert message in str(err.value)


def test_a_request_whose_controls_exclude_every_token_fails_alone(llm):
    tok = llm.tokenizer
    word = next(w for w in ("hello", "the", "a") if len(tokenize_bad_words(tok, [w])[0]) == 1)
    only = tokenize_bad_words(tok, [word])[0][0]
    prompts = random_prompts([7, 9, 11], seed=20)
    good = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)]
    bad = SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=[only], bad_words=[word])
    outs = _gen(llm, prompts, [good[0], bad, good[1]])
    assert outs[1].error is not None and outs[1].error_type == "invalid_request_error"
    assert outs[1].outputs[0].finish_reason == "error" and "no token can be sampled" in outs[1].error
    for out, prompt, params in zip((outs[0], outs[2]), (prompts[0], prompts[2]), good):
        assert out.error is None
        assert _tokens(out) == _tokens(_gen(llm, [prompt], params)[0])


# ---- property: any mix in one batch equals each request alone ---------------------------------------------------

def _random_params(rng: random.Random, vocab: int, tok) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.7)
    kw["temperature"] = rng.choice([0, 0.8, 1.3])
    kw["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.5:
        kw["repetition_penalty"] = rng.choice([0.7, 1.2, 2.0])
    if rng.random() < 0.5:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.5:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(1, 5))}
    if rng.random() < 0.3:
        kw["allowed_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    if rng.random() < 0.3:
        kw["bad_words"] = [tok.decode([rng.randrange(1000, vocab)]).strip() or "x" for _ in range(2)]
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.3:
        kw["n"] = rng.randint(1, 3)
        if rng.random() < 0.5:
            kw["best_of"] = kw["n"] + rng.randint(0, 2)
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randint(0, 3)
    return SamplingParams(**kw)


def test_random_mixes_in_one_batch_equal_each_request_alone(llm):
    rng = random.Random(1234)
    vocab = llm.engine.model_config.vocab_size
    for round_ in range(3):
        size = rng.randint(3, 7)
        prompts = random_prompts([rng.randint(2, 40) for _ in range(size)], seed=100 + round_)
        params = [_random_params(rng, vocab, llm.tokenizer) for _ in range(size)]
        batch = _gen(llm, prompts, params)
        for prompt, p, out in zip(prompts, params, batch):
            alone = _gen(llm, [prompt], p)[0]
            assert (out.error is None) == (alone.error is None), (p, out.error, alone.error)
            assert _tokens(out) == _tokens(alone), p
            assert [c.finish_reason for c in out.outputs] == [c.finish_reason for c in alone.outputs]
            for c, a in zip(out.outputs, alone.outputs):
                if c.cumulative_logprob is not None:
                    assert c.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)
