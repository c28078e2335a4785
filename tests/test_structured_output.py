"""Structured output: JSON schemas, regex, choice, grammars and JSON objects, offline and over HTTP."""

from __future__ import annotations

import json
import random
import re
import string
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from tapllm import LLM, HiddenStatesSpec, SamplingParams, StructuredOutputsParams

from server_util import Server


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", max_num_seqs=64)


# ---- a seeded generator of JSON schemas of varied shape ---------------------------------------
def _name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema: objects (required and optional properties, nested), arrays with bounds, enums,
    integers (some bounded), numbers, booleans, strings with maxLength."""
    leaves = ["integer", "number", "boolean", "string", "enum"]
    kind = rng.choice(leaves + ["object", "array"] * (2 if depth < 2 else 0))
    if kind == "object":
        names = list(dict.fromkeys(_name(rng) for _ in range(rng.randint(1, 4))))
        props = {n: random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.75],
                "additionalProperties": False}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 3)}
    if kind == "integer":
        s: dict = {"type": "integer"}
        if rng.random() < 0.5:
            s["minimum"] = rng.randint(-50, 10)
            s["maximum"] = s["minimum"] + rng.randint(0, 1000)
        return s
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 12)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, s["maxLength"])
        return s
    if kind == "enum":
        pool = [_name(rng), _name(rng) + " " + _name(rng), rng.randint(-9, 99), None, True, 2.5]
        return {"enum": list({json.dumps(v): v for v in rng.sample(pool, rng.randint(1, 4))}.values())}
    return {"type": kind}


def random_schemas(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        s = random_schema(rng)
        if s.get("type") in ("object", "array"):  # a document, not a bare scalar
            out.append(s)
    return out


# ---- offline ----------------------------------------------------------------------------------
def test_50_random_json_schemas_every_output_validates(llm):
    schemas = random_schemas(50, seed=7)
    # Compact JSON: under flexible whitespace a random-weight model writes whitespace runs of
    # hundreds of tokens (whitespace tokens are many); the default is tested with the real model.
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for i, s in enumerate(schemas)]
    outs = llm.generate(["Reply in JSON:"] * len(schemas), params)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    # Unconstrained, the same model writes no JSON document.
    free = llm.generate(["Reply in JSON:"] * 4, SamplingParams(temperature=1.0, seed=0, max_tokens=20))
    assert not any(isinstance(_parsed(o.outputs[0].text), dict | list) for o in free)


def test_regex_choice_and_grammars(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}(\.[A-Z])?"
    gbnf = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]? [a-z]?'
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'
    choices = ["red", "green", "deep blue"]
    params = []
    for seed in range(6):
        params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs={"regex": regex}),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs={"choice": choices}),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs={"grammar": gbnf}),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs={"grammar": lark})]
    outs = llm.generate(["Answer:"] * len(params), params)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        kind = i % 4
        if kind == 0:
            assert re.fullmatch(regex, c.text), c.text
        elif kind == 1:
            assert c.text in choices
        elif kind == 2:
            assert re.fullmatch(r"(hello|hi) [a-z]{1,3}!", c.text), c.text
        else:
            assert re.fullmatch(r"\([1-9](\+[1-9])*\)", c.text), c.text
    assert len({o.outputs[0].text for o in outs[1::4]}) > 1  # sampled, not forced to one answer


def test_greedy_constrained_picks_the_best_allowed_token(llm, tiny_models):
    """Greedy under a choice takes the allowed token with the highest logit, and its logprob is
    over the allowed tokens only (as in vLLM); checked against transformers' logits."""
    from transformers import AutoModelForCausalLM

    choices = ["alpha", "beta", "gamma"]
    out = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=10, logprobs=0,
                                                  structured_outputs={"choice": choices}))[0]
    c = out.outputs[0]
    assert c.text in choices and c.finish_reason == "stop"
    tok = llm.tokenizer
    allowed = [t for t in range(len(tok)) if (piece := tok.decode([t])) and any(x.startswith(piece) for x in choices)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    sub = logits[allowed].log_softmax(-1)
    best = int(sub.argmax())
    assert c.token_ids[0] == allowed[best]
    assert abs(c.logprobs[0][c.token_ids[0]].logprob - float(sub[best])) < 1e-4


@pytest.mark.slow
def test_real_model_json_object_and_schema_under_flexible_whitespace(default_llm):
    """The real model writes a JSON object and stops; a schema's output ends where the JSON does."""
    msgs = [{"role": "user", "content": "Describe a cat as a JSON object with its name and age."}]
    out = default_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=200,
                                                structured_outputs={"json_object": True}))[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 40}},
              "required": ["name", "age"], "additionalProperties": False}
    out = default_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=200,
                                                structured_outputs={"json": schema}))[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_num_seqs=8)


def test_bad_specs_fail_alone_at_admission(llm):
    engine = llm.engine
    bad = [({"json": {"type": "strnig"}}, "structured_outputs.json"),
           ({"json": '{"type": "object", '}, "structured_outputs.json"),
           ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json"),
           ({"regex": "([a-z]"}, "structured_outputs.regex"),
           ({"grammar": 'root ::= ("a" | '}, "structured_outputs.grammar"),
           ({"choice": []}, "structured_outputs.choice"),
           ({"regex": "a", "choice": ["b"]}, "exactly one")]
    for spec, field in bad:
        with pytest.raises((ValueError, TypeError), match=re.escape(field)):
            engine.input_processor.prepare("Hi", SamplingParams(max_tokens=8, structured_outputs=spec))
    # Good requests around the refused ones run to completion; the cache compiled each spec once.
    prepared = [engine.input_processor.prepare("Hi", SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                                               structured_outputs={"choice": ["yes", "no"]})) for s in range(3)]
    good = [engine.add(p) for p in prepared]
    while engine.has_unfinished_requests():
        engine.step()
    assert all(r.finish_reason == "stop" and r.text in ("yes", "no") for r in good)
    assert prepared[0].grammar is prepared[1].grammar is prepared[2].grammar  # one spec, checked once
    assert list(engine.grammars._cache).count(prepared[0].grammar.text) == 1  # compiled once for the three
    assert good[0].grammar.matcher is not good[1].grammar.matcher


def test_a_failing_row_fails_alone_in_the_step(llm):
    """A constrained request whose matcher breaks mid-run fails alone; the batch completes."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_outputs={"choice": ["on", "off"]})
              for s in range(4)]
    engine = llm.engine
    reqs = [engine.add(engine.input_processor.prepare("Switch:", p)) for p in params]
    reqs[1].grammar.matcher.consume_token(0)  # a token the grammar refuses: the matcher is in error now
    while engine.has_unfinished_requests():
        engine.step()
    assert reqs[1].finish_reason == "error" and "structured_outputs.choice" in reqs[1].error
    assert all(r.finish_reason == "stop" and r.text in ("on", "off") for i, r in enumerate(reqs) if i != 1)


def test_hidden_states_and_steering_on_structured_requests(llm, tiny_models):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    spec = HiddenStatesSpec(layers=[0, -1], points=["resid_post"], positions="all")
    so = {"json": schema, "disable_any_whitespace": True}
    steer = {"layers": [1], "point": "resid_post", "vector": [0.5] * 64, "scale": 4.0}
    outs = llm.generate(["Data:", "Data:", "Plain:"], [
        SamplingParams(temperature=0, max_tokens=40, hidden_states=spec, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=40, hidden_states=spec, structured_outputs=so, steering=[steer]),
        SamplingParams(temperature=0, max_tokens=8)])
    plain_hs, steered_hs = outs[0].hidden_states, outs[1].hidden_states
    for out in outs[:2]:
        c = out.outputs[0]
        jsonschema.validate(json.loads(c.text), schema)
        tokens = out.prompt_token_ids + c.token_ids
        assert out.hidden_states.positions.tolist() == list(range(len(tokens) - 1))
    # The states are those of the tokens actually produced: equal to running them as a prompt.
    c = outs[0].outputs[0]
    ref = llm.encode([outs[0].prompt_token_ids + c.token_ids[:-1]], spec)[0].hidden_states
    assert torch.allclose(plain_hs["resid_post"], ref["resid_post"], atol=1e-4)
    # The steer reached the constrained request's residual stream.
    n = len(outs[0].prompt_token_ids)
    assert not torch.allclose(steered_hs["resid_post"][:n, 1], plain_hs["resid_post"][:n, 1], atol=1e-3)


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(TypeError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="unknown key"):
        SamplingParams(structured_outputs={"jsn": {}})
    p = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert p.structured_outputs.json == {"type": "object"} and p.structured_outputs.kind == "json"


# ---- server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_models):
    s = Server(tiny_models["llama"], "--enable-hidden-states", "--max-num-seqs", "16")
    yield s
    s.stop()


def test_server_structured_fields(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "w": {"type": "string", "maxLength": 5}},
              "required": ["n", "w"], "additionalProperties": False}
    client = server.client()
    msgs = [{"role": "user", "content": "JSON please"}]
    # Greedy: sampled, a random-weight model writes whitespace runs for ever under the default
    # flexible whitespace (compact JSON is tested offline); greedy, it closes the object.
    r = client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=400, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=60, seed=1,
                                       extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert r.choices[0].message.content in ("up", "down")
    r = client.completions.create(model="tiny_llama", prompt="Code:", max_tokens=20, seed=2,
                                  extra_body={"guided_regex": "[A-F]{4}"})
    assert re.fullmatch("[A-F]{4}", r.choices[0].text)
    r = client.completions.create(model="tiny_llama", prompt="Yes?", max_tokens=20, seed=2,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model="tiny_llama", prompt="Hi", max_tokens=20, seed=2,
                                  extra_body={"guided_grammar": 'root ::= "a" "b"? "c"'})
    assert r.choices[0].text in ("ac", "abc")
    r = client.completions.create(model="tiny_llama", prompt="Hi", max_tokens=400, temperature=0,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=5,
                                       response_format={"type": "text"})
    assert r.choices[0].message.content is not None  # unconstrained


def test_server_bad_structured_fields_are_400_naming_the_field(server):
    chat = {"model": "tiny_llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
            "response_format.json_schema.schema"),
           ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
           ({"response_format": {"type": "xml"}}, "response_format"),
           ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
           ({"structured_outputs": {"regx": "a"}}, "structured_outputs"),
           ({"guided_json": "{not json"}, "guided_json"),
           ({"guided_choice": []}, "guided_choice"),
           ({"guided_grammar": "root ::= ("}, "guided_grammar"),
           ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")]
    good = {**chat, "structured_outputs": {"choice": ["ok"]}}
    with ThreadPoolExecutor(4) as pool:  # refused requests next to good ones: those still complete
        futures = [(pool.submit(server.post, "/v1/chat/completions", {**chat, **extra}), field)
                   for extra, field in bad]
        goods = [pool.submit(server.post, "/v1/chat/completions", good) for _ in range(3)]
        for fut, field in futures:
            status, body = fut.result()
            assert status == 400, (field, body)
            err = body["error"]
            assert field in err["message"] or field in (err["param"] or ""), (field, err)
        for fut in goods:
            status, body = fut.result()
            assert status == 200 and body["choices"][0]["message"]["content"] == "ok"


def _parsed(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def test_warm_tokenizer_is_the_one_requests_use(tiny_models):
    from tapllm.engine.tokenizer import load_tokenizer
    from tapllm.structured.compiler import GrammarCompiler
    from tapllm.structured.params import StructuredOutputsParams

    tok = load_tokenizer(tiny_models["llama"])
    compiler = GrammarCompiler(tok, len(tok), [0])
    compiler.warm_in_background().join(timeout=120)
    built = compiler._lltokenizer
    assert built is not None
    grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    assert compiler.matcher(grammar) is not None and compiler._lltokenizer is built
