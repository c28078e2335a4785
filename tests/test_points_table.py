"""The one table of points (``tapllm.tap.points``) and what reads it: the docs, the checks, the CLI help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tapllm.cli.args import SPEC_HELP
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.steering.spec import Steer
from tapllm.tap.points import (HEAD_STEER_POINTS, MOE_POINTS, MOE_STEER_POINTS, POINTS, QUERY_HEAD_POINTS, STEER_POINTS,
                               TABLE, row_shapes)

POINTS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "hidden-states.md"


def test_the_docs_list_every_point_with_its_row_shape_in_table_order():
    rows = re.findall(r"^\| `(\w+)` \| .*? \| `\[([\w, ]+)\]` \|", POINTS_PAGE.read_text(), re.M)
    assert [name for name, _ in rows] == list(POINTS)
    assert {name: tuple(shape.split(", ")) for name, shape in rows} == {p.name: p.shape for p in TABLE}


def test_groups_follow_from_the_table():
    assert STEER_POINTS == ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "q", "k", "v", "z",
                            "mlp_post", "router_logits", "routing_weights", "shared_expert_out")
    assert MOE_POINTS == ("router_logits", "router_probs", "routing_weights", "experts_chosen", "expert_out",
                          "shared_expert_out")
    assert MOE_STEER_POINTS == ("router_logits", "routing_weights")  # the router's: expert ids, ban, force
    assert HEAD_STEER_POINTS == ("q", "k", "v", "z") and QUERY_HEAD_POINTS == ("q", "z", "attn_pattern")
    dims = {"hidden": 8, "heads": 4, "kv_heads": 2, "head_dim": 2, "d_mlp": 32}
    assert row_shapes(dims)["k"] == (2, 2) and "attn_pattern" not in row_shapes(dims)  # keys vary
    assert "shared_expert_out" not in row_shapes(dims)  # a model exposes it only with a shared expert
    assert row_shapes(dims, frozenset({"shared_expert"}))["shared_expert_out"] == (8,)


@pytest.mark.parametrize("point", POINTS)
def test_every_point_is_capturable_and_only_the_steerable_ones_steer(point):
    HiddenStatesSpec(points=[point], experts=[0] if point == "expert_out" else None)
    if point in STEER_POINTS:
        Steer(layers=[0], point=point, op="scale", scale=2.0)
    else:
        with pytest.raises(ValueError, match="unknown point"):
            Steer(layers=[0], point=point, op="scale", scale=2.0)
    assert point in SPEC_HELP
