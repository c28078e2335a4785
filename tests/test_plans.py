"""The capture and steering plans on their own: built from row spans, applied to plain tensors, no model."""

from __future__ import annotations

import pytest
import torch

from tapllm.hidden_states.capture import RequestCapture
from tapllm.hidden_states.plan import CapturePlan, record_at
from tapllm.hidden_states.resolved import resolve
from tapllm.hidden_states.sink import CopySink
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.steering.plan import SteeringPlan, _AddRows, _Op
from tapllm.steering.resolved import RequestSteering, resolve_steering
from tapllm.steering.spec import Steer
from tapllm.tap import RowSpan

CPU = torch.device("cpu")
HIDDEN, LAYERS = 4, 2


def capture(num_prompt: int, max_positions: int, **spec: object) -> RequestCapture:
    """A request's capture of ``spec`` over a 2-block model of hidden size 4."""
    hs = HiddenStatesSpec(**spec)
    sel = resolve(hs, num_layers=LAYERS, hidden_size=HIDDEN, model_dtype=torch.float32, num_prompt=num_prompt,
                  max_positions=max_positions, encode=False)
    return RequestCapture(sel, hs, CPU)


def steering(num_prompt: int, *steers: Steer, dtype: torch.dtype = torch.float32) -> RequestSteering:
    resolved = resolve_steering(list(steers), LAYERS, HIDDEN, dtype, 8)
    return RequestSteering(resolved, b"digest", num_prompt)


def step_states(rows: int, layer: int) -> torch.Tensor:
    """A step's states at one layer: row r holds 100 * layer + r everywhere."""
    return (100.0 * layer + torch.arange(rows, dtype=torch.float32))[:, None].expand(rows, HIDDEN).clone()


def test_capture_plan_gathers_each_requests_rows_and_delivers_them_by_position():
    a = capture(3, 6, layers=[0, 1], points=["resid_post"])
    b = capture(2, 4, layers=[1], points=["resid_post"], positions="generated")
    # a's prompt at rows 0..2; b decodes position 2 at row 3 (its positions 0..1 came before).
    b.next_pos = 2
    plan = CapturePlan([(RowSpan(0, 0, 3), a, []), (RowSpan(3, 2, 1), b, [])], CPU, CopySink(staged=False))
    assert plan and sorted(plan.targets) == [("resid_post", 0), ("resid_post", 1)]
    for layer in range(LAYERS):
        record_at(plan.targets[("resid_post", layer)], step_states(4, layer))
    assert plan.finish() == {}
    got_a = a.result()["resid_post"]
    assert got_a.shape == (3, 2, HIDDEN)
    assert got_a[:, 0, 0].tolist() == [0, 1, 2] and got_a[:, 1, 0].tolist() == [100, 101, 102]
    got_b = b.result()
    assert got_b.positions.tolist() == [2] and got_b["resid_post"][:, 0, 0].tolist() == [103]


def test_capture_plan_uses_an_index_for_rows_that_are_not_contiguous():
    a = capture(2, 2, layers=[0], points=["resid_pre"])
    b = capture(2, 2, layers=[0], points=["resid_pre"])
    plan = CapturePlan([(RowSpan(0, 0, 2), a, []), (RowSpan(5, 0, 2), b, [])], CPU, CopySink(staged=False))
    (pp, _), = [plan.targets[("resid_pre", 0)]]
    assert isinstance(pp.rows, torch.Tensor) and pp.rows.tolist() == [0, 1, 5, 6]
    record_at(plan.targets[("resid_pre", 0)], step_states(7, 0))
    plan.finish()
    assert b.result()["resid_pre"][:, 0, 0].tolist() == [5, 6]


def test_a_chunk_outside_the_selection_makes_no_entry():
    done = capture(4, 4, layers=[0], points=["resid_post"], positions="last_prompt")
    plan = CapturePlan([(RowSpan(0, 0, 2), done, [])], CPU, CopySink(staged=False))  # positions 0..1 only
    assert not plan and plan.targets == {}


def test_finish_refuses_a_point_the_model_never_recorded():
    a = capture(2, 2, layers=[0], points=["mlp_out"])
    plan = CapturePlan([(RowSpan(0, 0, 2), a, [])], CPU, CopySink(staged=False))
    with pytest.raises(RuntimeError, match="never recorded point 'mlp_out'"):
        plan.finish()


def test_a_capture_that_fails_is_returned_alone_and_the_others_advance():
    good = capture(2, 2, layers=[0], points=["resid_post"])
    bad = capture(2, 2, layers=[0], points=["resid_post"])

    def refuse(*args: object) -> None:
        raise ValueError("plugin says no")

    bad.consume = refuse  # type: ignore[method-assign]
    plan = CapturePlan([(RowSpan(0, 0, 2), good, []), (RowSpan(2, 0, 2), bad, [])], CPU, CopySink(staged=False))
    record_at(plan.targets[("resid_post", 0)], step_states(4, 0))
    failed = plan.finish()
    assert list(failed) == [bad] and "plugin says no" in failed[bad]
    assert good.next_pos == 2 and bad.next_pos == 0


def test_plain_additions_at_one_point_merge_into_one_index_add():
    x = Steer(layers=[0], point="resid_post", op="add", vector=torch.ones(HIDDEN), scale=2.0)
    y = Steer(layers=[0], point="resid_post", op="add", vector=torch.ones(HIDDEN), scale=-1.0)
    plan = SteeringPlan([(RowSpan(0, 0, 2), steering(2, x)), (RowSpan(3, 0, 1), steering(1, y))], CPU)
    ops = plan.ops[("resid_post", 0)]
    assert len(ops) == 1 and isinstance(ops[0], _AddRows)
    t = torch.zeros(5, HIDDEN)
    ops[0].apply(t)
    assert t[:, 0].tolist() == [2, 2, 0, -1, 0]  # row 2 and 4 belong to nobody steered


def test_a_requests_additions_round_in_its_order_whatever_shares_the_point():
    """Several adds of one request at a point round to bfloat16 one after the other, as the request alone
    and its unmerged ops do, whether the step merges its adds with a neighbour's or a neighbour's ablate
    at that point keeps every op apart (index_add_ would sum a row listed twice in float32, rounding once)."""
    g = torch.Generator().manual_seed(0)
    vectors = [torch.randn(HIDDEN, generator=g) for _ in range(3)]
    mine = [Steer(layers=[0], point="resid_post", op="add", vector=v, scale=3.0) for v in vectors]
    late = Steer(layers=[0], point="resid_post", op="add", vector=vectors[0], scale=0.5, positions="generated")
    adds = steering(2, *mine, late, dtype=torch.bfloat16)
    x = (torch.randn(4, HIDDEN, generator=g) * 40).to(torch.bfloat16)
    want = x[:2].clone()
    for s in adds.steers[:3]:
        want = want + s.payload[0]  # one rounding per add, in order (the generated-only add is not due)
    alone_sum = (x[:2].float() + sum(s.payload[0].float() for s in adds.steers[:3])).to(torch.bfloat16)
    assert not torch.equal(want, alone_sum)  # the example tells the two orders apart
    neighbours = {
        "alone": [],
        "adding": [(RowSpan(3, 5, 1), steering(4, Steer(layers=[0], point="resid_post", vector=vectors[1]),
                                              dtype=torch.bfloat16))],
        "ablating": [(RowSpan(3, 5, 1), steering(4, Steer(layers=[0], point="resid_post", op="ablate",
                                                          vector=vectors[2]), dtype=torch.bfloat16))],
    }
    for name, others in neighbours.items():
        plan = SteeringPlan([(RowSpan(0, 0, 2), adds), *others], CPU)
        t = x.clone()
        for op in plan.ops[("resid_post", 0)]:
            op.apply(t)
        assert torch.equal(t[:2], want), name
        assert torch.equal(t[2], x[2]), name


def test_steers_act_only_on_their_positions_and_in_order():
    scale = Steer(layers=[1], point="resid_pre", op="scale", scale=3.0, positions="generated")
    add = Steer(layers=[1], point="resid_pre", op="add", vector=torch.ones(HIDDEN), positions=[4])
    # Positions 2..4 of a request with a 3-token prompt sit at rows 1..3.
    plan = SteeringPlan([(RowSpan(1, 2, 3), steering(3, scale, add))], CPU)
    ops = plan.ops[("resid_pre", 1)]
    assert [type(op) for op in ops] == [_Op, _Op]
    t = torch.ones(5, HIDDEN)
    for op in ops:
        op.apply(t)
    assert t[:, 0].tolist() == [1, 1, 3, 4, 1]  # position 2 is the prompt's: not scaled


def test_a_steer_outside_the_chunk_makes_no_plan():
    late = Steer(layers=[0], point="resid_post", op="add", vector=torch.ones(HIDDEN), positions=[9])
    assert not SteeringPlan([(RowSpan(0, 0, 4), steering(4, late))], CPU)
