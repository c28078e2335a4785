"""The interpretability toolkit over HTTP: prompt logprobs (echo, vLLM's prompt_logprobs), new points, lens, patches."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from server_util import serving
from tapllm import LLM, SamplingParams
from tapllm.client import decode_hidden_states
from tapllm.hidden_states.json_codec import tensor_to_wire


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from serving(tiny_models["llama"], "--enable-hidden-states", "--enable-steering")


@pytest.fixture(scope="module")
def reference(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def test_echo_and_prompt_logprobs(server, reference):
    prompt = random_prompts([9], seed=61)[0]
    ref = reference.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2,
                                                      prompt_logprobs=2), use_tqdm=False)[0]
    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                   "ignore_eos": True, "logprobs": 2, "echo": True,
                                                   "prompt_logprobs": 2})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3 and lp["token_logprobs"][0] is None
    assert choice["text"].endswith(ref.outputs[0].text) and len(choice["text"]) > len(ref.outputs[0].text)
    for i in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][i] - ref.prompt_logprobs[i][prompt[i]].logprob) < 1e-5
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    assert abs(plp[4][str(prompt[4])]["logprob"] - ref.prompt_logprobs[4][prompt[4]].logprob) < 1e-5
    # streamed echo is served (test_server_api.py); with logprobs it is refused: those come only at the end
    status, body = server.post("/v1/completions", {"prompt": prompt, "echo": True, "stream": True, "logprobs": 1})
    assert status == 400 and "echo" in body["error"]["message"]


def test_head_points_lens_and_patching_over_http(server, reference):
    clean, corrupted = random_prompts([8, 8], seed=62)
    spec = {"layers": [1], "points": ["z", "attn_pattern", "resid_post"], "positions": "all", "heads": [0, 2],
            "lens": 2}
    status, body = server.post("/v1/hidden_states", {"input": [clean], "hidden_states": spec})
    assert status == 200, body
    hs = decode_hidden_states(body["data"][0])
    ref = reference.encode([clean], spec)[0].hidden_states
    for point in ("z", "attn_pattern", "resid_post"):
        assert torch.allclose(hs[point], ref[point], atol=1e-5)
    assert torch.equal(hs.lens.token_ids, ref.lens.token_ids)
    patch = {"op": "set", "point": "resid_post", "layers": [1], "positions": [3, 5],
             "values": tensor_to_wire(ref["resid_post"][[3, 5], 0], "base64")}
    status, body = server.post("/v1/completions", {"prompt": corrupted, "max_tokens": 4, "temperature": 0,
                                                   "ignore_eos": True, "steering": [patch]})
    assert status == 200, body
    from tapllm import Steer

    want = reference.generate([corrupted], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, steering=[
        Steer(op="set", point="resid_post", layers=[1], positions=[3, 5], values=ref["resid_post"][[3, 5], 0])]),
        use_tqdm=False)[0]
    assert body["choices"][0]["text"] == want.outputs[0].text
