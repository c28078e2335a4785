"""vLLM drop-in server API (issue 15): embeddings, tokenize/detokenize, echo, chat template options,
strict request fields and latency metrics, against the real ``tapllm serve`` with the official client."""

from __future__ import annotations

import base64
import struct
import time

import pytest
import torch

from server_util import Server
from tapllm import LLM, HiddenStatesSpec, SamplingParams

openai = pytest.importorskip("openai")

# A ChatML template that reads one extra variable, so chat_template_kwargs has a visible effect.
TEMPLATE = (
    "{%- if persona %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_models, template_file):
    s = Server(tiny_models["llama"], "--enable-hidden-states", "--chat-template", str(template_file))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_models, template_file):
    return LLM(tiny_models["llama"], dtype="float32", chat_template=str(template_file))


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def test_embeddings_equal_llm_encode(server, reference, tiny_models):
    from transformers import AutoModelForCausalLM

    client = server.client()
    prompts = ["The capital of France is", "Embeddings from a decoder"]
    ref = reference.encode(prompts, HiddenStatesSpec(points="final", positions="prompt", reduce="last",
                                                     dtype="float32"), use_tqdm=False)
    want = [_unit(r.hidden_states["final"].reshape(-1)) for r in ref]
    # the yardstick: transformers' last hidden state (after the final norm) at the last position
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32)
    with torch.no_grad():
        for r, w in zip(ref, want):
            h = hf(torch.tensor([r.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
            assert torch.allclose(_unit(h), w, atol=1e-5)
    # the official client asks for base64 by default and decodes it; "float" sends lists
    for fmt in (openai.NOT_GIVEN, "float"):
        r = client.embeddings.create(model="tiny_llama", input=prompts, encoding_format=fmt)
        assert [d.index for d in r.data] == [0, 1]
        for d, w in zip(r.data, want):
            assert torch.allclose(torch.tensor(d.embedding), w, atol=1e-6)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(x.prompt_token_ids) for x in ref)
    # base64 is little-endian float32, as OpenAI writes it
    status, body = server.post("/v1/embeddings", {"input": prompts[0], "encoding_format": "base64"})
    assert status == 200, body
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert torch.allclose(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), want[0], atol=1e-6)
    # another point, block and pooling, unnormalised; token-id input
    ids = [[5, 6, 7, 8, 9], [10, 11, 12]]
    for pooling in ("mean", "first"):
        r = client.embeddings.create(model="tiny_llama", input=ids, encoding_format="float", extra_body={
            "point": "resid_post", "layer": 1, "pooling": pooling, "normalize": False})
        ref = reference.encode(ids, HiddenStatesSpec(layers=[1], points="resid_post", positions="prompt",
                                                     reduce=pooling, dtype="float32"), use_tqdm=False)
        for d, x in zip(r.data, ref):
            assert torch.allclose(torch.tensor(d.embedding), x.hidden_states["resid_post"].reshape(-1), atol=1e-5)
        assert r.usage.prompt_tokens == 8
    # refusals name their field
    for body, field in [({"input": "x", "dimensions": 8}, "dimensions"), ({"input": "x", "point": "q"}, "point"),
                        ({"input": "x", "layer": 0}, "layer"), ({"input": "x", "point": "resid_pre", "layer": 3},
                                                                "layer"),
                        ({"input": "x", "pooling": "max"}, "pooling"), ({"input": []}, "input"),
                        ({"input": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
                        ({"input": "x", "colour": 1}, "colour")]:
        status, resp = server.post("/v1/embeddings", body)
        assert status == 400 and field in resp["error"]["message"], (body, resp)
    status, _ = server.post("/v1/embeddings", {"input": "x", "dimensions": 64, "user": "u1"})
    assert status == 200  # the full width is accepted; user is metadata


def test_tokenize_and_detokenize(server, reference):
    tok = reference.tokenizer
    text = "Tokenize me, please: héllo wörld!"
    status, body = server.post("/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200, body
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    status, back = server.post("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": text}
    assert server.post("/tokenize", {"prompt": text})[1]["token_strs"] is None
    # a chat, rendered as /v1/chat/completions renders it
    messages = [{"role": "user", "content": "Hi"}]
    status, body = server.post("/tokenize", {"messages": messages, "chat_template_kwargs": {"persona": "Terse."}})
    rendered = reference.apply_chat_template(messages, chat_template_kwargs={"persona": "Terse."})
    assert rendered.startswith("<|im_start|>system\nTerse.")
    assert status == 200 and body["tokens"] == tok.encode(rendered, add_special_tokens=False)
    # continue_final_message: the last message stays open
    prefill = [*messages, {"role": "assistant", "content": "The answer is"}]
    status, body = server.post("/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                             "continue_final_message": True})
    assert status == 200 and tok.decode(body["tokens"]).endswith("<|im_start|>assistant\nThe answer is")
    for path, bad, field in [
        ("/tokenize", {"messages": prefill, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": True}},
         "chat_template_kwargs.add_generation_prompt"),
        ("/tokenize", {"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
        ("/detokenize", {"tokens": [5, 49152]}, "tokens[1]"),
        ("/detokenize", {"tokens": [5, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": [5, "6"]}, "tokens.1"),
    ]:
        status, resp = server.post(path, bad)
        assert status == 400 and field in resp["error"]["message"], (bad, resp)


def test_chat_template_options_equal_llm_chat(server, reference):
    client = server.client()
    messages = [{"role": "user", "content": "Name a colour."}]
    kwargs = {"persona": "You answer in one word."}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = reference.chat(messages, params, use_tqdm=False, chat_template_kwargs=kwargs)[0]
    plain = reference.chat(messages, params, use_tqdm=False)[0]
    assert ref.prompt_token_ids != plain.prompt_token_ids
    r = client.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "chat_template_kwargs": kwargs})
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    # continue the assistant's message
    prefill = [*messages, {"role": "assistant", "content": "My favourite is"}]
    ref = reference.chat(prefill, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    r = client.chat.completions.create(model="tiny_llama", messages=prefill, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "add_generation_prompt": False,
                                                   "continue_final_message": True})
    assert r.choices[0].message.content == ref.outputs[0].text
    assert ref.prompt.endswith("My favourite is")
    # vLLM's prompt_logprobs on chat: beside the choices, whole or with the last chunk of a stream
    want = reference.chat(messages, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
                          use_tqdm=False)[0]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    status, resp = server.post("/v1/chat/completions", body)
    assert status == 200, resp
    plp = resp["prompt_logprobs"]
    ids = want.prompt_token_ids
    assert plp[0] is None and len(plp) == len(ids)
    assert abs(plp[3][str(ids[3])]["logprob"] - want.prompt_logprobs[3][ids[3]].logprob) < 1e-5
    stream = list(client.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, extra_body={"prompt_logprobs": 1}))
    assert stream[-1].model_extra["prompt_logprobs"] == plp
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model="tiny_llama", messages=prefill, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_echo(server, reference):
    client = server.client()
    prompt = "Echo this prompt"
    ref = reference.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                      prompt_logprobs=1), use_tqdm=False)[0]
    common = dict(model="tiny_llama", prompt=prompt, temperature=0, echo=True, extra_body={"ignore_eos": True})
    r = client.completions.create(**common, max_tokens=4)
    assert r.choices[0].text == prompt + ref.outputs[0].text
    chunks = list(client.completions.create(**common, max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + ref.outputs[0].text
    # max_tokens=0 scores the prompt alone (vLLM): its text and logprobs, nothing generated
    r = client.completions.create(**common, max_tokens=0, logprobs=1)
    lp = r.choices[0].logprobs
    n = len(ref.prompt_token_ids)
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0 and len(lp.token_logprobs) == n
    assert lp.token_logprobs[0] is None
    for i in range(1, n):
        assert abs(lp.token_logprobs[i] - ref.prompt_logprobs[i][ref.prompt_token_ids[i]].logprob) < 1e-5
    chunks = list(client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=2, stream=True,
                                            extra_body={"prompt_logprobs": 0}))
    plp = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert plp[-1][0] is None and len(plp[-1]) == n and all(p is None for p in plp[:-1])
    with pytest.raises(openai.BadRequestError, match="echo with stream=true and logprobs"):
        client.completions.create(**common, max_tokens=2, logprobs=1, stream=True)


def test_fields_not_implemented_are_refused_by_name(server):
    client = server.client()
    ok = {"prompt": "Hello", "max_tokens": 2}
    user = {"role": "user", "content": "Hi"}
    cases = [
        ("/v1/completions", {**ok, "colour": "red"}, "colour: unknown field"),
        ("/v1/completions", {**ok, "suffix": "!"}, "suffix is not supported"),
        ("/v1/completions", {**ok, "use_beam_search": True}, "use_beam_search is not supported"),
        ("/v1/completions", {**ok, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats is not supported"),
        ("/v1/completions", {**ok, "stream_options": {"include_usage": True}}, "stream_options is only allowed"),
        ("/v1/chat/completions", {"messages": [user], "top_logprobs": 2}, "top_logprobs needs logprobs=true"),
        ("/v1/chat/completions", {"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tools is not supported"),
        ("/v1/chat/completions", {"messages": [{**user, "tool_call_id": "x"}]}, "messages[0].tool_call_id"),
        ("/v1/chat/completions", {"messages": [user], "chat_template": "{{ 1 }}"}, "chat_template is not supported"),
    ]
    for path, body, message in cases:
        status, resp = server.post(path, body)
        assert status == 400 and message in resp["error"]["message"], (body, resp)
    with pytest.raises(openai.BadRequestError, match="typo_field: unknown field"):
        client.completions.create(model="tiny_llama", prompt="Hi", max_tokens=2, extra_body={"typo_field": 1})
    # a known field set to the value that asks for nothing is accepted
    status, resp = server.post("/v1/chat/completions", {"messages": [user], "max_tokens": 2, "tools": [],
                                                        "store": False, "priority": 0, "user": "u1"})
    assert status == 200, resp


def _metrics(server) -> dict[str, float]:
    _, text = server.get("/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_latency_histograms_count_requests(server):
    before = _metrics(server)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for _ in range(2):
        status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 5
    after = _metrics(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    h = "tapllm:"
    assert grew(h + "e2e_request_latency_seconds_count") == 2
    assert grew(h + "time_to_first_token_seconds_count") == 2
    assert grew(h + "request_queue_time_seconds_count") == 2
    assert grew(h + "inter_token_latency_seconds_count") == 2 * 4  # every token after the first
    assert grew(h + "request_time_per_output_token_seconds_count") == 2
    assert grew(h + "request_prompt_tokens_sum") == 2 * 7 and grew(h + "request_generation_tokens_sum") == 2 * 5
    assert grew(h + "prompt_tokens_total") == 14 and grew(h + "generation_tokens_total") == 10
    assert 0 < grew(h + "time_to_first_token_seconds_sum") <= grew(h + "e2e_request_latency_seconds_sum")
    assert 0 < grew(h + "inter_token_latency_seconds_sum") < grew(h + "e2e_request_latency_seconds_sum")
    # the bucket counts are cumulative and end at the total
    _, text = server.get("/metrics")
    buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(h + "e2e_request_latency_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after[h + "e2e_request_latency_seconds_count"]
    # the gauges under vLLM's names, and the original series, are still there
    for name in (h + "num_requests_running", h + "num_requests_waiting", h + "kv_cache_usage_perc",
                 h + "prefix_cache_queries_total", "tapllm_prefix_cache_hit_rate", "tapllm_prompt_tokens_total"):
        assert name in after, name
    # the engine thread refreshes its gauges just after answering: give it a moment
    deadline = time.time() + 10
    while _metrics(server)[h + "num_requests_running"] != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert _metrics(server)[h + "num_requests_running"] == 0


def test_chat_template_option_is_checked_before_the_model_loads(tiny_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="chat_template"):
        LLM(tiny_models["llama"], chat_template=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        LLM(tiny_models["llama"], chat_template=str(bad))
