"""tapllm on Ray Serve (``tapllm.serving.ray``) on a local 2-node Ray cluster, one CPU per node.

Checked here: the two engine replicas sit on different nodes; completions, chat (plain,
streamed, and with hidden states through ``extra_body``) over real HTTP through Ray Serve's
proxy equal a local ``LLM`` run; the replica's own app answers errors as ``tapllm serve``
does; requests sharing a long prompt prefix all land on the replica that holds it (the
``x-tapllm-replica`` header), whose prefix cache then serves it, and a new prefix goes to the
least busy replica, as ``tapllm serve --data-parallel-size`` routes; a client that leaves a
stream has its request aborted in the replica's engine.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch

from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.client import decode_hidden_states
from tapllm.serving.options import RayServeOptions

from server_util import chat_equals_llm, free_port, same_states

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from tapllm.serving.ray import REPLICA_HEADER, app  # noqa: E402

APP = "tapllm"
SPEC = {"layers": [0, -1], "points": ["resid_post", "attn_out"], "positions": "all"}


@pytest.fixture(scope="module")
def deployed(tiny_models):
    """The deployment of the tiny Llama on a head node and a worker node (1 CPU each)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    port = free_port()
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        options = RayServeOptions(model=str(tiny_models["llama"]), num_replicas=2, cpus_per_replica=1,
                                  served_model_name="tiny_llama",
                                  engine={"dtype": "float32", "enable_hidden_states": True})
        serve.run(app(options), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_models):
    """The local engine, with one intra-op thread as each replica computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_models["llama"], dtype="float32")
    torch.set_num_threads(threads)


def post(url: str, path: str, body: dict | bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """Status, JSON body and the answering replica of a POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), r.headers.get(REPLICA_HEADER)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get(REPLICA_HEADER)


def get_text(url: str, path: str, replica: int) -> str:
    req = urllib.request.Request(url + path, headers={REPLICA_HEADER: str(replica)})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers.get(REPLICA_HEADER) == str(replica)
        return r.read().decode()


def metric(text: str, name: str) -> float:
    return next(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_one_engine_replica_per_node(deployed):
    where = [serve.get_deployment_handle(f"tapllm-engine-{i}", app_name=APP).where.remote().result()
             for i in range(2)]
    assert [w["index"] for w in where] == [0, 1]
    assert len({w["node_id"] for w in where}) == 2  # a replica on each node
    assert all(w["torch_threads"] == 1 for w in where)


def test_answers_equal_a_local_llm(deployed, reference):
    client = openai.OpenAI(base_url=deployed + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny_llama"]
    prompt = "The capital of France is"
    ref = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                      hidden_states=HiddenStatesSpec(**SPEC)), use_tqdm=False)[0]
    common = dict(model="tiny_llama", prompt=prompt, max_tokens=8, temperature=0)
    plain = client.completions.create(**common, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == ref.outputs[0].text and decode_hidden_states(plain.choices[0]) is None
    r = client.completions.create(**common, extra_body={"ignore_eos": True, "hidden_states": SPEC})
    assert r.choices[0].text == ref.outputs[0].text and r.usage.completion_tokens == 8
    same_states(decode_hidden_states(r.choices[0]), ref.hidden_states)
    chunks = list(client.completions.create(**common, stream=True,
                                            extra_body={"ignore_eos": True, "hidden_states": SPEC}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    same_states(decode_hidden_states(final.choices[0]), ref.hidden_states)

    chat_equals_llm(client, reference, SPEC, stream_states=False)


def test_errors_are_the_servers(deployed):
    status, body, replica = post(deployed, "/v1/completions", {"prompt": "x", "max_tokens": -1})
    assert status == 400 and "max_tokens" in body["error"]["message"] and replica in ("0", "1")
    status, body, _ = post(deployed, "/v1/completions", b"{not json")
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    status, body, _ = post(deployed, "/v1/completions", {"prompt": "x"}, {REPLICA_HEADER: "7"})
    assert status == 400 and REPLICA_HEADER in body["error"]["message"]


def test_a_prefix_goes_to_the_replica_holding_it(deployed):
    front = serve.get_app_handle(APP)
    prefix = list(range(100, 100 + 96))  # six full KV blocks of 16 tokens

    def send(tokens: list[int]) -> int:
        status, body, replica = post(deployed, "/v1/completions", {"prompt": tokens, "max_tokens": 2})
        assert status == 200, body
        return int(replica)

    holder = send(prefix + [7])
    for tail in ([8], [9, 10], [11]):
        hits = metric(get_text(deployed, "/metrics", holder), "tapllm_prefix_cache_hits_total")
        assert send(prefix + tail) == holder
        after = metric(get_text(deployed, "/metrics", holder), "tapllm_prefix_cache_hits_total")
        assert after >= hits + 96  # the whole prefix came from that replica's cache
    routing = front.routing.remote().result()
    assert routing[holder]["affinity_routed"] >= 3 and all(r["in_flight"] == 0 for r in routing)
    # a new prefix: the least busy replica (none in flight: the one sent fewer requests)
    least = min(range(2), key=lambda i: routing[i]["routed"])
    assert send(list(range(300, 396))) == least


def test_a_client_leaving_a_stream_aborts_it_in_the_replica(deployed):
    url = urllib.parse.urlsplit(deployed)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Tell me a long story", "max_tokens": 450,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    replica = int(resp.getheader(REPLICA_HEADER))
    aborted = metric(get_text(deployed, "/metrics", replica), "tapllm_requests_aborted_total")
    assert resp.readline().startswith(b"data: ")  # the first token has arrived
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        text = get_text(deployed, "/metrics", replica)
        if metric(text, "tapllm_requests_aborted_total") > aborted and metric(text, "tapllm_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric(text, "tapllm_requests_aborted_total") == aborted + 1
    assert metric(text, "tapllm_requests_running") == 0 and metric(text, "tapllm_kv_cache_usage_ratio") == 0
    assert all(r["in_flight"] == 0 for r in serve.get_app_handle(APP).routing.remote().result())
