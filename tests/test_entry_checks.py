"""Values checked where they enter the Python API (issue 50, item 5): every ``SamplingParams`` field's
type, named in the message; steering and state values finite and within the range of the dtype they are
computed in, also named (the HTTP side of the same checks: ``test_server_edges.py``)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.hidden_states.json_codec import tensor_from_wire
from tapllm.sampling_params import FIELD_TYPES, UNSUPPORTED_FIELDS
from tapllm.steering.spec import Steer


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    """A value that overflows somewhere on its way (a NumPy cast) fails the test instead of warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def test_every_field_has_a_type_check():
    init = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert init == set(FIELD_TYPES) | set(UNSUPPORTED_FIELDS)


class _Odd:
    """A value of no type any field takes."""


@pytest.mark.parametrize("field", sorted(FIELD_TYPES))
def test_a_value_of_the_wrong_type_is_named(field):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got _Odd$"):
        SamplingParams(**{field: _Odd()})


@pytest.mark.parametrize("kwargs, message", [
    (dict(stop=5), "stop must be a string or a list of strings, got int"),
    (dict(stop=["a", 5]), "stop must be a string or a list of strings, got list holding int and str"),
    (dict(stop={"a": 1}), "stop must be a string or a list of strings, got dict"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of integers, got int"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids must be a list of integers, got list holding float"),
    (dict(bad_words=7), "bad_words must be a string or a list of strings, got int"),
    (dict(allowed_token_ids="12"), "allowed_token_ids must be a list of integers, got str"),
    (dict(steering=5), "steering must be a Steer, a dict, or a list of them, got int"),
    (dict(hidden_states=["resid_post"]), "hidden_states must be a HiddenStatesSpec or a dict, got list"),
    (dict(temperature="hot"), "temperature must be a number, got str"),
    (dict(top_k=2.0), "top_k must be an integer, got float"),
    (dict(n=True), "n must be an integer, got bool"),
    (dict(ignore_eos=1), "ignore_eos must be true or false, got int"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias must be a dict of token id -> bias, got list holding tuple"),
    (dict(extra_args=[1]), "extra_args must be a dict or None, got list holding int"),
    (dict(output_kind=1.0), "output_kind must be a RequestOutputKind or its name, got float"),
    (dict(temperature=1e39), r"temperature is 1e\+39, beyond the range of float32 \(at most 3.403e\+38"),
    (dict(repetition_penalty=-1e39), "repetition_penalty is -1e"),
    (dict(logit_bias={5: "x"}), r"logit_bias\[5\] must be a number, got 'x'"),
])
def test_sampling_params_messages(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**kwargs)


def test_the_forms_that_were_accepted_still_are():
    p = SamplingParams(stop=("a", "b"), stop_token_ids=np.array([3, 4]), allowed_token_ids=range(5, 8),
                       bad_words="zz", steering={"layers": [0], "vector": [1.0] * 4}, output_kind="delta")
    assert p.stop_strings == ("a", "b") and p.bad_words == ["zz"]
    assert p.stop_token_ids == [3, 4] and all(type(t) is int for t in p.stop_token_ids)
    assert p.allowed_token_ids == [5, 6, 7]
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3)).top_k == 3


def test_validate_checks_types_again_after_a_change():
    p = SamplingParams()
    p.stop = 5
    with pytest.raises(ValueError, match="^stop must be a string or a list of strings, got int"):
        p.validate()


# ---- steering and state values ---------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: Steer(layers=[0], vector=[1e39] * 4), r"steering\.vector holds 1e\+39, beyond the range of float32"),
    (lambda: Steer(layers=[0], vector=torch.full((4,), -1e39, dtype=torch.float64)), r"steering\.vector holds 1e\+39"),
    (lambda: Steer(vector={0: [1e39] * 4}), r"steering\.vector\[0\] holds 1e\+39"),
    (lambda: Steer(layers=[0], vector=[float("nan")] * 4), r"steering\.vector holds NaN or infinite values"),
    (lambda: Steer(layers=[0], vector=[1.0] * 4, scale=1e39), r"steering\.scale is 1e\+39, beyond the range of float32"),
    (lambda: Steer(layers=[0], op="clamp", vector=[1.0] * 4, value=-1e39), r"steering\.value is -1e\+39"),
    (lambda: Steer(layers=[0], op="set", positions=[0], values=[[1e39] * 4]), r"steering\.values holds 1e\+39"),
    (lambda: Steer(layers=[0], vector={"shape": [4], "dtype": "float16", "data": [1e5] * 4}),
     r"steering\.vector\.data holds 100000, beyond the range of float16 \(at most 6\.55e\+04"),
    (lambda: HiddenStatesSpec(project=[[1e39] * 4]), r"hidden_states\.project holds 1e\+39"),
    (lambda: tensor_from_wire({"shape": [1], "dtype": "bfloat16", "data": [1e39]}, "x"), r"x\.data holds 1e\+39"),
])
def test_steering_and_state_values_are_checked_where_they_enter(make, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        make()


def test_a_wire_tensor_keeps_its_non_finite_values():
    """Decoding a response's states: NaN (a mean over nothing) and infinities pass; only a finite value that
    the dtype cannot hold is refused."""
    t = tensor_from_wire({"shape": [3], "dtype": "float32", "data": [float("nan"), float("-inf"), 1.0]})
    assert torch.isnan(t[0]) and t[1] == float("-inf") and t[2] == 1


@pytest.fixture(scope="module")
def llm_bf16(tiny_models):
    return LLM(tiny_models["llama"], dtype="bfloat16")


@pytest.mark.parametrize("steer, message", [
    (dict(layers=[0], op="clamp", vector=[1.0] * 64, value=3.395e38),
     r"steering\[0\]\.value is 3\.395e\+38, beyond the range of bfloat16"),
    (dict(layers=[0], op="scale", scale=-3.395e38), r"steering\[0\]\.scale is -3\.395e\+38, beyond the range of bfloat16"),
    (dict(layers=[0], vector=[3.395e38] * 64), r"steering\[0\]: scale \* vector at layer 0 overflows"),
])
def test_values_beyond_the_models_dtype_are_refused_by_name(llm_bf16, steer, message):
    prompt = random_prompts([5], seed=1)[0]
    with pytest.raises(ValueError, match=message):
        llm_bf16.generate([prompt], SamplingParams(max_tokens=2, steering=[steer]), use_tqdm=False)
    assert not llm_bf16.engine.has_unfinished_requests()
    assert llm_bf16.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None
