"""The real server (``tapllm serve`` in a subprocess) on a tiny mixture-of-experts model, over HTTP.

The ``hidden_states`` extension returns the router and expert points (binary base64 and JSON lists) equal to
``LLM.generate``'s for the same request; the ``steering`` extension bans an expert, which then never appears
in ``experts_chosen``, with the tokens and states of ``LLM.generate`` under the same ban. Bad expert
selections get a 400 naming the field.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts, save_tiny_model
from family_configs import moe_configs
from server_util import KEY, Server, close
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.client import decode_hidden_states
from test_family_moe import _init

openai = pytest.importorskip("openai")

SPEC = {"layers": "all", "points": ["router_logits", "routing_weights", "experts_chosen", "expert_out",
                                    "shared_expert_out"], "positions": "all", "experts": [2, 0]}
BAN = {"layers": [0, 2], "point": "router_logits", "op": "ban", "experts": [1]}  # Qwen2-MoE: block 1 is dense


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_folder):
    return save_tiny_model(tmp_path_factory.mktemp("server_moe") / "qwen2_moe", moe_configs()["qwen2_moe"],
                           default_model_folder, init=_init)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--enable-hidden-states", "--enable-steering", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(model):
    return LLM(model, dtype="float32")


def same_states(got, ref) -> None:
    """As ``server_util.same_states``, NaN rows (the dense block's) included: NaN at the same places."""
    assert got is not None and got.positions.tolist() == ref.positions.tolist() and got.layers == ref.layers
    assert got.points == ref.points
    for p in ref.points:
        assert torch.equal(got[p].isnan(), ref[p].isnan()), p
        close(got[p].nan_to_num(), ref[p].nan_to_num())


def _reference(llm: LLM, prompt: list[int], steering: list[Steer] | None):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, steering=steering,
                            hidden_states=HiddenStatesSpec(**SPEC))
    return llm.generate([prompt], params, use_tqdm=False)[0]


@pytest.mark.parametrize("encoding", ["base64", "list"])
def test_router_and_expert_points_equal_llm(encoding, server, reference):
    prompt = random_prompts([9], seed=71)[0]
    ref = _reference(reference, prompt, None)
    r = server.client().completions.create(model="tiny_llama", prompt=prompt, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True,
                                                       "hidden_states": {**SPEC, "encoding": encoding}})
    assert r.choices[0].text == ref.outputs[0].text
    got = decode_hidden_states(r.choices[0])
    same_states(got, ref.hidden_states)
    assert got["expert_out"].shape[2:] == (2, 64)


def test_a_banned_expert_is_never_chosen(server, reference):
    prompt = random_prompts([12], seed=72)[0]
    ref = _reference(reference, prompt, [Steer(**BAN)])
    plain = _reference(reference, prompt, None)
    assert (plain.hidden_states["experts_chosen"][:, [0, 2], 1] == 1).any()  # the ban has something to do
    r = server.client().completions.create(model="tiny_llama", prompt=prompt, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, "hidden_states": SPEC,
                                                       "steering": [BAN]})
    assert r.choices[0].text == ref.outputs[0].text
    got = decode_hidden_states(r.choices[0])
    same_states(got, ref.hidden_states)
    assert (got["experts_chosen"][:, [0, 2], 1] == 0).all()
    assert (got["routing_weights"][:, [0, 2], 1] == 0).all()


@pytest.mark.parametrize("extension, message", [
    ({"hidden_states": {"points": ["expert_out"], "experts": [4]}},
     "hidden_states.experts: expert 4 is out of range for 4 experts"),
    ({"hidden_states": {"points": ["expert_out"]}}, "hidden_states.experts is required with point 'expert_out'"),
    ({"hidden_states": {"points": ["expert_out"], "experts": [-1]}}, "hidden_states.experts: expert ids must be >= 0"),
    ({"steering": [{**BAN, "experts": [7]}]}, "steering[0].experts: expert 7 is out of range for 4 experts"),
])
def test_bad_expert_selections_get_a_400_naming_the_field(extension, message, server):
    code, resp = server.post("/v1/completions", {"model": "tiny_llama", "prompt": [5, 6, 7], "max_tokens": 2,
                                                 **extension})
    assert code == 400 and message in resp["error"]["message"], resp
    assert server.post("/v1/completions", {"model": "tiny_llama", "prompt": [5, 6], "max_tokens": 2})[0] == 200
