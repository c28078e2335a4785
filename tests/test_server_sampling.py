"""The server takes vLLM's sampling fields through the official ``openai`` client and returns n choices."""

from __future__ import annotations

import openai
import pytest

from conftest import random_prompts
from server_util import KEY, serving
from tapllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from serving(tiny_models["llama"], "--api-key", KEY, "--enable-hidden-states")


@pytest.fixture(scope="module")
def reference(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def test_new_fields_equal_the_offline_engine(server, reference):
    client = server.client()
    prompt = random_prompts([12], seed=30)[0]
    extra = dict(repetition_penalty=1.5, min_tokens=3, bad_words=["the"], allowed_token_ids=list(range(100, 4000)),
                 truncate_prompt_tokens=8, ignore_eos=True)
    resp = client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=6, temperature=0, n=2,
                                     presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"150": 5.0},
                                     extra_body=extra)
    params = SamplingParams(max_tokens=6, temperature=0, n=2, presence_penalty=0.5, frequency_penalty=0.3,
                            logit_bias={150: 5.0}, **extra)
    ref = reference.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [c.text for c in ref.outputs]
    assert resp.usage.prompt_tokens == 8 and resp.usage.completion_tokens == 12


def test_n_choices_whole_and_streamed(server, reference):
    client = server.client()
    prompts = [random_prompts([9], seed=31)[0], random_prompts([14], seed=32)[0]]
    kw = dict(model="tiny_llama", prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=3,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == list(range(6))
    refs = reference.generate(prompts, SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3, ignore_eos=True),
                              use_tqdm=False)
    expect = {i * 3 + j: c.text for i, r in enumerate(refs) for j, c in enumerate(r.outputs)}
    assert {c.index: c.text for c in whole.choices} == expect
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert streamed == expect and finished == set(range(6))
    chat = client.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, n=2, temperature=1.0, seed=1, stream=True)
    texts: dict[int, str] = {}
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert set(texts) == {0, 1}


def test_best_of_and_bad_values(server):
    client = server.client()
    resp = client.completions.create(model="tiny_llama", prompt="Hello", max_tokens=4, n=1, best_of=3,
                                     temperature=1.0, seed=2, logprobs=0)
    assert len(resp.choices) == 1
    for kwargs, message in [
        (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
        (dict(logit_bias={"99999999": 1.0}), "logit_bias: token id 99999999 is outside the vocabulary"),
        (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty must be > 0"),
        (dict(n=2, best_of=1), "best_of must be an integer >= n (2)"),
        (dict(best_of=2, stream=True), "streaming needs best_of equal to n"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny_llama", prompt="Hello", max_tokens=2, **kwargs)
        assert message in str(err.value)
    assert client.completions.create(model="tiny_llama", prompt="Hello", max_tokens=2).choices[0].text is not None
