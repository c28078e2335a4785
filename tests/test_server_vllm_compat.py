"""The server as a vLLM drop-in (issue 23): stop reasons and texts over HTTP, echo logprobs, error bodies,
/v1/models, /metrics families and JSON-schema strictness, each as vLLM 0.32 answers it."""

from __future__ import annotations

import json

import pytest

from conftest import random_prompts
from server_util import serving
from tapllm import LLM, SamplingParams, StructuredOutputsParams
from tapllm.server.metrics import VLLM_FAMILIES
from tapllm.structured.compiler import GrammarCompiler, closed_objects


@pytest.fixture(scope="module")
def server(tiny_models):
    yield from serving(tiny_models["llama"])


@pytest.fixture(scope="module")
def reference(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def test_stop_reasons_and_texts_over_http(server, reference):
    prompt = random_prompts([8], seed=71)[0]
    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                   "logit_bias": {"2": 100}, "skip_special_tokens": False})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None and choice["text"] == ""
    text = reference.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    stop = text[4:7]
    for stream in (False, True):
        status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                       "ignore_eos": True, "stop": [stop], "stream": stream,
                                                       "include_stop_str_in_output": True})
        assert status == 200, body
        chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")] if stream else [body]
        got = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert got == text[: text.index(stop) + len(stop)]


def test_echo_and_sampled_logprobs_hold_the_token(server, reference):
    prompt = random_prompts([12], seed=72)[0]
    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 1.5,
                                                   "seed": 3, "ignore_eos": True, "logprobs": 1, "echo": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    ref = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True,
                                                      logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    ranks = [None] + [ref.prompt_logprobs[i][t].rank for i, t in enumerate(prompt) if i] + \
        [entry[t].rank for t, entry in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert lp["top_logprobs"][0] is None and any(r > 1 for r in ranks[1:])
    for token, top, rank in zip(lp["tokens"][1:], lp["top_logprobs"][1:], ranks[1:]):
        assert token in top and len(top) == (1 if rank == 1 else 2), (token, top, rank)


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": list(range(600))}, "input_tokens"),
    ({"echo": True, "stream": True, "logprobs": 1}, "echo"),
    ({"model": "nope"}, "model"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_error_bodies_are_vllms(server, body, param):
    status, got = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, **body})
    code = 404 if param == "model" else 400
    assert status == code, got
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["code"] == code and got["error"]["param"] == param
    assert got["error"]["type"] == ("NotFoundError" if code == 404 else "BadRequestError")


def test_unknown_route_error_body(server):
    status, got = server.get("/v1/nothing")
    assert status == 404 and got["error"]["type"] == "NotFoundError" and got["error"]["code"] == 404


def test_models_lists_vllms_fields(server):
    status, body = server.get("/v1/models")
    assert status == 200, body
    card = body["data"][0]
    assert card["id"] == "tiny_llama" and card["parent"] is None and card["root"].endswith("llama")
    assert card["max_model_len"] == 512 and card["created"] > 0
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] and not perm["allow_fine_tuning"]


def test_metrics_have_vllms_families(server):
    server.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "n": 2, "temperature": 1})
    status, text = server.get("/metrics")
    assert status == 200
    types = [line.split()[2:] for line in text.splitlines() if line.startswith("# TYPE ")]
    families = {name.removesuffix("_total") if kind == "counter" else name for name, kind in types}
    missing = [f for f in VLLM_FAMILIES if "tapllm:" + f not in families]
    assert not missing, missing
    assert server.metric('tapllm:request_params_n_count') >= 1
    assert server.metric('tapllm:iteration_tokens_total_count') >= 1
    assert server.metric('tapllm:engine_sleep_state{sleep_state="awake"}') == 1


def test_json_schema_objects_are_closed_unless_asked(reference):
    tok = reference.tokenizer
    compiler = GrammarCompiler(tok, 49152, [2])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = tok.encode('{"a": 1, "b": 2}', add_special_tokens=False)

    def refused(**kw):
        m = compiler.matcher(compiler.compile(StructuredOutputsParams(json=schema, **kw)))
        return any(m.accept(t) is not None for t in extra)

    assert refused() and not refused(disable_additional_properties=False)
    open_schema = {**schema, "additionalProperties": True}
    m = compiler.matcher(compiler.compile(StructuredOutputsParams(json=open_schema)))
    assert all(m.accept(t) is None for t in extra)  # an explicit additionalProperties is honoured
    nested = {"type": "object", "properties": {"x": {"properties": {"y": {}}}, "z": {"type": "array", "items": {
        "type": "object"}}}, "$defs": {"d": {"type": ["object", "null"]}}}
    closed = closed_objects(nested)
    assert closed["additionalProperties"] is False and closed["properties"]["x"]["additionalProperties"] is False
    assert closed["properties"]["z"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False and "additionalProperties" not in nested
