"""The step's tap on its own: what a model's calls do to the batch and what reaches each request."""

from __future__ import annotations

import torch

from tapllm.engine.step_tap import StepTap
from tapllm.hidden_states.capture import RequestCapture
from tapllm.hidden_states.resolved import resolve
from tapllm.hidden_states.sink import CopySink
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.layers.attention import AttentionOptions
from tapllm.steering.resolved import RequestSteering, resolve_steering
from tapllm.steering.spec import Steer
from tapllm.tap import PSEUDO_LAYER, RowSpan, no_tap

CPU = torch.device("cpu")
HIDDEN, LAYERS, HEADS, HEAD_DIM = 4, 2, 2, 3
SHAPES = {"q": (HEADS, HEAD_DIM), "z": (HEADS, HEAD_DIM), "k": (1, HEAD_DIM), "v": (1, HEAD_DIM)}


def capture(num_prompt: int, **spec: object) -> RequestCapture:
    hs = HiddenStatesSpec(**spec)
    sel = resolve(hs, num_layers=LAYERS, hidden_size=HIDDEN, model_dtype=torch.float32, num_prompt=num_prompt,
                  max_positions=num_prompt, encode=True, point_shapes=SHAPES)
    return RequestCapture(sel, hs, CPU)


def steering(num_prompt: int, *steers: Steer) -> RequestSteering:
    return RequestSteering(resolve_steering(list(steers), LAYERS, HIDDEN, torch.float32, 8, SHAPES), b"d",
                           num_prompt)


def test_no_capture_and_no_steer_builds_no_tap():
    sink = CopySink(staged=False)
    assert StepTap.build([], [], CPU, sink) is None
    finished = capture(3, layers=[0], positions="last_prompt")
    finished.next_pos = 3  # its one position was captured by an earlier step
    late = Steer(layers=[0], point="resid_post", op="add", vector=torch.ones(HIDDEN), positions=[7])
    assert StepTap.build([(RowSpan(0, 0, 3), finished, [])], [(RowSpan(0, 0, 3), steering(3, late))], CPU,
                         sink) is None


def test_the_tap_steers_first_and_captures_the_steered_rows():
    cap = capture(2, layers=[1], points=["resid_mid"])
    add = Steer(layers=[1], point="resid_mid", op="add", vector=torch.full((HIDDEN,), 10.0))
    span = RowSpan(1, 0, 2)  # rows 1..2 of a 4-row step; rows 0 and 3 belong to other requests
    tap = StepTap.build([(span, cap, [])], [(span, steering(2, add))], CPU, CopySink(staged=False))
    assert tap is not None
    x = torch.zeros(4, HIDDEN)
    assert tap("resid_mid", 1, x) is x
    assert x[:, 0].tolist() == [0, 10, 10, 0]
    assert tap.finish() == {}
    assert cap.result()["resid_mid"][:, 0, 0].tolist() == [10, 10]


def test_points_and_layers_nobody_asked_for_pass_untouched():
    cap = capture(2, layers=[0], points=["resid_post"])
    tap = StepTap.build([(RowSpan(0, 0, 2), cap, [])], [], CPU, CopySink(staged=False))
    x = torch.randn(2, HIDDEN)
    before = x.clone()
    for point, layer in (("resid_post", 1), ("resid_pre", 0), ("embed", PSEUDO_LAYER), ("final", PSEUDO_LAYER)):
        assert tap(point, layer, x) is x
    assert torch.equal(x, before) and not tap.wants_pattern(0)
    assert no_tap("resid_post", 0, x) is x and not no_tap.wants_pattern(0)


def test_attention_patterns_are_computed_for_the_requests_that_asked():
    cap = capture(3, layers=[1], points=["attn_pattern"])
    tap = StepTap.build([(RowSpan(0, 0, 3), cap, [1])], [], CPU, CopySink(staged=False))
    assert tap.wants_pattern(1) and not tap.wants_pattern(0)
    torch.manual_seed(0)
    q = torch.randn(3, HEADS, HEAD_DIM)
    k_cache = torch.randn(1, 2, 4, HEAD_DIM)  # [kv heads, blocks, block size, head dim]: the request owns block 1
    opts = AttentionOptions(scale=HEAD_DIM**-0.5)
    tap.pattern(1, q, k_cache, opts)
    assert tap.finish() == {}
    got = cap.result()["attn_pattern"]  # [positions, layers, heads, keys]
    keys = k_cache[0, 1, :3]
    scores = torch.einsum("nhd,kd->nhk", q, keys) * opts.scale
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    want = scores.masked_fill(~causal[:, None, :], float("-inf")).softmax(-1)
    assert got.shape == (3, 1, HEADS, 3)
    torch.testing.assert_close(got[:, 0], want)
