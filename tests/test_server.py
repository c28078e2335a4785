"""The real server (uvicorn in a subprocess) driven by the official openai client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.client import decode_hidden_states

from server_util import KEY, Server, chat_equals_llm, close, same_states

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_models):
    s = Server(tiny_models["llama"], "--enable-hidden-states", "--enable-steering", "--api-key", KEY,
               "--hidden-states-max-bytes", "400000", "--max-num-seqs", "32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(tiny_models):
    s = Server(tiny_models["llama"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


SPEC = {"layers": [0, -1], "points": ["resid_post", "attn_out"], "positions": "all"}


def test_completions_and_chat_equal_llm(server, reference):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny_llama"]
    prompt = "The capital of France is"
    ref = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                      hidden_states=HiddenStatesSpec(**SPEC)), use_tqdm=False)[0]
    common = dict(model="tiny_llama", prompt=prompt, max_tokens=8, temperature=0)
    # without states: plain OpenAI response, no extension field
    plain = client.completions.create(**common, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == ref.outputs[0].text
    assert decode_hidden_states(plain.choices[0]) is None
    # with states, base64 and list encodings
    for encoding in ("base64", "list"):
        r = client.completions.create(**common, extra_body={"ignore_eos": True,
                                                            "hidden_states": {**SPEC, "encoding": encoding}})
        assert r.choices[0].text == ref.outputs[0].text and r.usage.completion_tokens == 8
        same_states(decode_hidden_states(r.choices[0]), ref.hidden_states)
    # streaming: text deltas, then the states with the final chunk of the choice
    chunks = list(client.completions.create(**common, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "hidden_states": SPEC}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    same_states(decode_hidden_states(final.choices[0]), ref.hidden_states)
    assert chunks[-1].usage.completion_tokens == 8

    chat_equals_llm(client, reference, SPEC, stream_states=True)  # chat, through the chat template

    # logprobs come back OpenAI-style
    r = client.completions.create(**common, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 8 and all(len(t) == 2 for t in lp.top_logprobs)


def test_prompt_only_states_endpoint(server, reference):
    prompts = ["Embed this sentence.", [5, 6, 7, 8, 9]]
    spec = {"layers": [1], "points": ["final", "resid_mid"], "positions": "prompt"}
    status, body = server.post("/v1/hidden_states", {"input": prompts, "hidden_states": spec})
    assert status == 200, body
    refs = reference.encode(prompts, spec, use_tqdm=False)
    for item, ref in zip(body["data"], refs):
        same_states(decode_hidden_states(item), ref.hidden_states)
    assert body["usage"]["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in refs)
    # a projection sent as a list of lists, reduced on the server
    dirs = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    status, body = server.post("/v1/hidden_states", {"input": prompts[0], "hidden_states": {
        **spec, "project": dirs.tolist(), "reduce": "mean"}})
    got = decode_hidden_states(body["data"][0])
    close(got["final"], (refs[0].hidden_states["final"] @ dirs.T).mean(0))


def test_32_concurrent_mixed_requests(server, reference):
    prompts = random_prompts([3 + 5 * i for i in range(32)], seed=12)
    specs = [None, {"layers": [0], "positions": "prompt"}, {"layers": [-1], "points": ["final"], "positions": "all"},
             {"layers": "all", "positions": "generated", "reduce": "mean"}]
    ref_params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                 hidden_states=HiddenStatesSpec(**specs[i % 4]) if specs[i % 4] else None)
                  for i in range(32)]
    refs = reference.generate(prompts, ref_params, use_tqdm=False)
    client = server.client()

    def one(i: int):
        extra = {"ignore_eos": True}
        if specs[i % 4]:
            extra["hidden_states"] = specs[i % 4]
        if i % 3 == 0:
            chunks = list(client.completions.create(model="tiny_llama", prompt=prompts[i], max_tokens=6,
                                                    temperature=0, stream=True, extra_body=extra))
            text = "".join(c.choices[0].text for c in chunks)
            return text, decode_hidden_states(chunks[-1].choices[0])
        r = client.completions.create(model="tiny_llama", prompt=prompts[i], max_tokens=6, temperature=0,
                                      extra_body=extra)
        return r.choices[0].text, decode_hidden_states(r.choices[0])

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for i, ((text, hs), ref) in enumerate(zip(results, refs)):
        assert text == ref.outputs[0].text, i
        if specs[i % 4] is None:
            assert hs is None
        else:
            same_states(hs, ref.hidden_states)


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, plain_server):
    ok = {"prompt": "Hello", "max_tokens": 2}
    cases = [
        (server, {**ok, "hidden_states": {"layers": [0], "colour": "red"}}, 400, "hidden_states.colour"),
        (server, {**ok, "hidden_states": {"points": ["resid_pots"]}}, 400, "unknown point 'resid_pots'"),
        (server, {**ok, "hidden_states": {"layers": [7]}}, 400, "layer 7 is out of range"),
        (server, {**ok, "hidden_states": {"layers": "all", "points": ["resid_pre", "resid_mid", "resid_post"],
                                          "positions": "all"}, "max_tokens": 200}, 400,
         "hidden_states_max_bytes_per_request=400,000"),
        (server, {**ok, "hidden_states": {"encoding": "hex"}}, 400, "hidden_states.encoding"),
        (server, {**ok, "max_tokens": "many"}, 400, "max_tokens"),
        (server, {**ok, "temperature": -1}, 400, "temperature must be >= 0"),
        (server, {**ok, "prompt": [[5] * 600]}, 400, "max_model_len"),
        (server, {**ok, "max_tokens": 600}, 400, "max_tokens: the prompt has 1 tokens and max_tokens is 600"),
        (server, {**ok, "model": "gpt-9"}, 404, "model 'gpt-9' does not exist"),
        (server, {**ok, "n": 0}, 400, "n must be an integer >= 1"),
        (server, {"max_tokens": 2}, 400, "prompt: Field required"),
        (plain_server, {**ok, "hidden_states": {"layers": [0]}}, 400, "does not serve hidden states"),
    ]
    for srv, body, status, message in cases:
        code, resp = srv.post("/v1/completions", body)
        assert code == status, (body, resp)
        assert message in resp["error"]["message"], (body, resp)
    code, resp = server.post("/v1/completions", b'{"prompt": "Hello", ')
    assert code == 400 and "malformed JSON" in resp["error"]["message"]
    code, resp = plain_server.post("/v1/hidden_states", {"input": "x"})
    assert code == 400 and "does not serve hidden states" in resp["error"]["message"]
    code, resp = server.post("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2})
    assert code == 400 and "messages[0].content is required" in resp["error"]["message"]
    code, resp = server.post("/v1/chat/completions", {"messages": [], "max_tokens": 2})
    assert code == 400 and "messages" in resp["error"]["message"]

    # authentication: health stays open, everything else needs the key
    assert server.get("/health", key=None)[0] == 200
    assert server.post("/v1/completions", ok, key=None)[0] == 401
    assert server.post("/v1/completions", ok, key="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()

    # still serving, and nothing stuck in the engine
    for srv in (server, plain_server):
        code, resp = srv.post("/v1/completions", ok)
        assert code == 200 and resp["choices"][0]["finish_reason"] in ("length", "stop")
    assert server.metric("tapllm_engine_step_errors_total") == 0


def test_client_disconnect_mid_stream_frees_the_request(server):
    aborted = server.metric("tapllm_requests_aborted_total")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": "Tell me a long story", "max_tokens": 500, "ignore_eos": True, "stream": True,
                       "hidden_states": {"layers": "all", "points": ["resid_post"], "positions": "generated",
                                         "reduce": "mean"}})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                   "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the first token has arrived
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        if (server.metric("tapllm_requests_aborted_total") > aborted and server.metric("tapllm_requests_running") == 0
                and server.metric("tapllm_kv_cache_usage_ratio") == 0):
            break
        time.sleep(0.1)
    assert server.metric("tapllm_requests_aborted_total") == aborted + 1
    assert server.metric("tapllm_requests_running") == 0 and server.metric("tapllm_kv_cache_usage_ratio") == 0
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
    _, text = server.get("/metrics")
    assert "tapllm_hidden_states_bytes_total" in text and "tapllm_requests_waiting" in text



def test_metrics_prefix_cache(server):
    def numbers() -> tuple[float, float, float]:
        return (server.metric("tapllm_prefix_cache_hits_total"), server.metric("tapllm_prefix_cache_queries_total"),
                server.metric("tapllm_prefix_cache_hit_rate"))

    hits, queries, _ = numbers()
    body = {"prompt": "the same long prompt again " * 8, "max_tokens": 1}  # a few full KV blocks
    for _ in range(2):
        assert server.post("/v1/completions", body)[0] == 200
    # the engine thread refreshes its numbers after each step and when idle
    deadline = time.time() + 10
    while numbers()[0] == hits and time.time() < deadline:
        time.sleep(0.1)
    new_hits, new_queries, rate = numbers()
    assert new_queries > queries and new_hits >= hits + 16  # the second request found the first one's blocks
    assert rate == pytest.approx(new_hits / new_queries)
    # no CUDA graphs on a CPU: the graph series are served, at zero
    assert server.metric("tapllm_graph_steps_total") == 0


def test_steering_extension(server, plain_server, reference):
    from tapllm import Steer
    from tapllm.hidden_states.json_codec import tensor_to_wire

    v = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 2
    steer = Steer(layers=[0, 2], point="resid_post", vector=v, scale=3.0)
    prompt = "Once upon a time"
    ref = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, steering=[steer],
                                                      hidden_states=HiddenStatesSpec(**SPEC)), use_tqdm=False)[0]
    plain = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0]
    assert ref.outputs[0].token_ids != plain.outputs[0].token_ids
    client = server.client()
    for vector in (tensor_to_wire(v, "base64"), v.tolist(), {"0": v.tolist(), "2": tensor_to_wire(v, "base64")}):
        body = {"point": "resid_post", "vector": vector, "scale": 3.0}
        if not isinstance(vector, dict) or "shape" in vector:
            body["layers"] = [0, 2]
        r = client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "steering": [body], "hidden_states": SPEC})
        assert r.choices[0].text == ref.outputs[0].text
        same_states(decode_hidden_states(r.choices[0]), ref.hidden_states)

    ok = {"prompt": "Hi", "max_tokens": 2}
    cases = [
        (plain_server, [{"layers": [0], "vector": v.tolist()}], "does not serve steering"),
        (server, [{"layers": [0], "vector": v[:32].tolist()}], "width 32, but the model's hidden size is 64"),
        (server, [{"layers": [9], "vector": v.tolist()}], "layer 9 is out of range"),
        (server, [{"layers": [0], "vector": {"shape": [64], "dtype": "float32",
                                              "data": tensor_to_wire(torch.full((64,), float("inf")), "base64")["data"]}}],
         "NaN or infinite"),
        (server, [{"layers": [0], "vector": v.tolist()}] * 17, "more than max_steers_per_request=16"),
        (server, [{"layers": [0], "vector": v.tolist(), "strength": 2}], "steering.0.strength"),
    ]
    for srv, steering, message in cases:
        code, resp = srv.post("/v1/completions", {**ok, "steering": steering})
        assert code == 400 and message in resp["error"]["message"], resp
    assert server.post("/v1/completions", ok)[0] == 200
