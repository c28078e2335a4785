"""Spec checks, instance policy, encode, the result object and its file, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_prompts
from helpers import greedy
from tapllm import LLM, HiddenStates, HiddenStatesSpec, SamplingParams
from tapllm.cli import main


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", hidden_states_max_bytes_per_request=20_000)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (dict(points=["resid_pots"]), r"hidden_states\.points: unknown point 'resid_pots'"),
        (dict(points=[]), r"hidden_states\.points is empty"),
        (dict(layers="some"), r"hidden_states\.layers must be 'all'"),
        (dict(layers=[]), r"hidden_states\.layers is empty"),
        (dict(layers=[0.5]), r"hidden_states\.layers must hold integers"),
        (dict(positions=(5, 5)), r"hidden_states\.positions: window \[5, 5\) is empty"),
        (dict(positions=(-1, 3)), r"hidden_states\.positions: window start must be >= 0"),
        (dict(positions="middle"), r"hidden_states\.positions: unknown selection 'middle'"),
        (dict(reduce="median"), r"hidden_states\.reduce: unknown reducer 'median'; available: \[.*'mean'"),
        (dict(dtype="int8"), r"hidden_states\.dtype must be one of"),
        (dict(project=torch.zeros(3)), r"hidden_states\.project must be a \[k, hidden\] matrix"),
        (dict(colour="red"), r"hidden_states: unknown key\(s\) \['colour'\]"),
    ],
)
def test_bad_spec_is_refused_at_construction(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(hidden_states=spec)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (dict(layers=[3]), r"prompts\[1\]: hidden_states\.layers: layer 3 is out of range for a 3-block model \(valid: -3\.\.2\)"),
        (dict(layers=[-4]), r"layer -4 is out of range"),
        (dict(layers=[0, -3]), r"hidden_states\.layers names a block twice"),
        (dict(positions=(2, 20)), r"hidden_states\.positions: window \[2, 20\) lies outside the sequence: .*end at or before 13"),
        (dict(positions="generated"), None),  # fine for generate; checked for encode below
        (dict(project=torch.zeros(2, 32)), r"hidden_states\.project has width 32, but the model's hidden size is 64"),
        (dict(points=["embed", "resid_pre", "attn_out"]), r"up to 23,296 bytes .* over hidden_states_max_bytes_per_request=20,000"),
    ],
)
def test_bad_spec_for_this_model_is_refused_and_others_unaffected(llm, spec, match):
    good, bad = random_prompts([6, 10], seed=1)
    if match is None:
        assert llm.generate([bad], greedy(4, hidden_states=spec), use_tqdm=False)[0].hidden_states is not None
        return
    # 10-token prompt, max_tokens 4: positions 0..12 can be computed
    with pytest.raises(ValueError, match=match):
        llm.generate([good, bad], [greedy(4, hidden_states=None), greedy(4, hidden_states=spec)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing of the refused call was queued
    out = llm.generate([good], greedy(4, hidden_states=dict(layers=[0])), use_tqdm=False)[0]
    assert out.hidden_states["resid_post"].shape == (6 + 4 - 1, 1, 64)


def test_byte_limit_counts_what_was_asked(llm):
    p = random_prompts([10], seed=1)[0]
    # 3 layers x 2 points x 64 x 4 bytes x 13 positions = 19,968 bytes: just within 20,000
    llm.generate([p], greedy(4, hidden_states=dict(points=["resid_pre", "resid_post"])), use_tqdm=False)
    # the same at 200 generated tokens would be over; reduced, it is tiny
    with pytest.raises(ValueError, match="could capture up to"):
        llm.generate([p], greedy(200, hidden_states=dict(points=["resid_pre", "resid_post"])), use_tqdm=False)
    llm.generate([p], greedy(200, hidden_states=dict(points=["resid_pre", "resid_post"], reduce="mean")),
                 use_tqdm=False)


def test_disabled_instance_refuses_states_but_serves_text(tiny_models):
    off = LLM(tiny_models["llama"], dtype="float32", enable_hidden_states=False)
    p = random_prompts([5], seed=2)[0]
    with pytest.raises(ValueError, match="enable_hidden_states=False"):
        off.generate([p], greedy(4, hidden_states=dict(layers=[0])), use_tqdm=False)
    with pytest.raises(ValueError, match="enable_hidden_states=False"):
        off.encode([p], use_tqdm=False)
    assert len(off.generate([p], greedy(4, hidden_states=None), use_tqdm=False)[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="hidden_states_max_bytes_per_request must be"):
        LLM(tiny_models["llama"], hidden_states_max_bytes_per_request=0)


def test_encode(llm):
    prompts = random_prompts([4, 9], seed=3)
    outs = llm.encode(prompts, dict(layers=[1], points=["resid_mid", "final"]), use_tqdm=False)
    spec = dict(layers=[1], points=["resid_mid", "final"], positions="prompt")
    gen = llm.generate(prompts, greedy(4, hidden_states=spec), use_tqdm=False)
    for p, e, g in zip(prompts, outs, gen):
        assert e.outputs == [] and e.finished
        assert e.hidden_states.positions.tolist() == list(range(len(p)))
        for point in ("resid_mid", "final"):
            torch.testing.assert_close(e.hidden_states[point], g.hidden_states[point], atol=1e-5, rtol=0)
    default = llm.encode(prompts[:1], use_tqdm=False)[0].hidden_states  # all blocks' resid_post
    assert default["resid_post"].shape == (4, 3, 64) and default.layers == [0, 1, 2]
    with pytest.raises(ValueError, match="'generated' selects nothing: encode generates no tokens"):
        llm.encode(prompts, dict(positions="generated"), use_tqdm=False)
    with pytest.raises(ValueError, match="hidden_states has 1 entries for 2 prompts"):
        llm.encode(prompts, [dict()], use_tqdm=False)


def test_encode_stops_after_the_deepest_captured_block(tiny_models):
    """A prompt-only capture of early blocks runs only those blocks; its states equal a full
    forward's, and its partial KV never serves a later request through the prefix cache."""
    llm = LLM(tiny_models["llama"], dtype="float32")
    runner = llm.engine.runner
    ran: list[int] = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, layer in enumerate(runner.model.layers)]
    prompts = random_prompts([40, 23, 17], seed=11)  # 40 tokens: whole blocks to cache
    shallow = dict(layers=[0, 1], points=["resid_pre", "attn_out", "resid_post"])
    try:
        outs = llm.encode(prompts, shallow, use_tqdm=False)
        assert set(ran) == {0, 1}  # block 2 never ran
        ran.clear()
        with_final = llm.encode(prompts, dict(shallow, points=["resid_post", "final"]), use_tqdm=False)
        assert set(ran) == {0, 1, 2}  # "final" needs every block
    finally:
        for h in hooks:
            h.remove()
    for e, f in zip(outs, with_final):
        torch.testing.assert_close(e.hidden_states["resid_post"], f.hidden_states["resid_post"], atol=1e-6, rtol=0)
    # The shallow encode published blocks whose block-2 KV was never written: generation of the
    # same prompts must not reuse them (same tokens as an engine that never saw them).
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    fresh = LLM(tiny_models["llama"], dtype="float32", enable_prefix_caching=False)
    llm.encode(prompts, shallow, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_result_object_and_file_round_trip(llm, tmp_path):
    p = random_prompts([7], seed=9)[0]
    spec = HiddenStatesSpec(layers=[0, 2], points=["embed", "attn_out"], positions=(2, 9), dtype="bfloat16")
    hs = llm.generate([p], greedy(4, hidden_states=spec), use_tqdm=False)[0].hidden_states
    assert hs.points == ("embed", "attn_out") and hs.layers == [0, 2]
    assert hs["embed"].shape == (7, 1, 64) and hs["attn_out"].shape == (7, 2, 64)
    assert hs["attn_out"].dtype == torch.bfloat16 and hs.positions.tolist() == list(range(2, 9))
    assert hs.nbytes == 7 * 3 * 64 * 2
    with pytest.raises(KeyError, match="was not captured"):
        hs["final"]

    path = hs.save(tmp_path / "s.safetensors", metadata={"note": "x"})
    assert [f.name for f in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary left behind
    back = HiddenStates.load(path)
    assert back.points == hs.points and back.layers == hs.layers and back.metadata == {"note": "x"}
    assert back.spec["positions"] == [2, 9]
    for point in hs:
        assert torch.equal(back[point], hs[point])
    assert torch.equal(back.positions, hs.positions)

    with pytest.raises(FileNotFoundError):
        hs.save(tmp_path / "missing" / "s.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="unreadable hidden-states file"):
        HiddenStates.load(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a tapllm hidden-states file"):
        HiddenStates.load(tmp_path / "other.safetensors")


def test_spec_parse_cli_form():
    spec = HiddenStatesSpec.parse("layers=0,-1 points=resid_post,final positions=3:9 reduce=mean dtype=float32")
    assert spec.layers == [0, -1] and spec.points == ("resid_post", "final") and spec.positions == (3, 9)
    assert spec.reduce == "mean" and spec.dtype == "float32"
    with pytest.raises(ValueError, match="unknown key 'layer'"):
        HiddenStatesSpec.parse("layer=0")
    with pytest.raises(ValueError, match="expected key=value"):
        HiddenStatesSpec.parse("mean")


def test_cli_generate_and_encode_with_states(tiny_models, tmp_path, capsys):
    model = str(tiny_models["llama"])
    save = tmp_path / "states.safetensors"
    rc = main(["generate", "Hello there", "--model", model, "--max-tokens", "5", "--quiet",
               "--hidden-states", "layers=0,-1 points=resid_post,final positions=prompt reduce=mean",
               "--save", str(save)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "reduce=mean" in out and "resid_post" in out and "(2, 64)" in out and "mean norm per layer" in out
    hs = HiddenStates.load(save)
    assert hs["resid_post"].shape == (2, 64) and json.loads(hs.metadata["prompt_token_ids"])

    assert main(["encode", "Hello there", "--model", model, "--quiet", "--hidden-states", "points=final"]) == 0
    assert "final" in capsys.readouterr().out

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a b c"}\n{"prompt_token_ids": [5, 6, 7, 8]}\n')
    outdir = tmp_path / "states"
    rc = main(["encode", "--input", str(inp), "--model", model, "--quiet", "--hidden-states", "layers=1",
               "--save", str(outdir), "--output", str(tmp_path / "out.jsonl")])
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert HiddenStates.load(outdir / rows[1]["hidden_states_file"])["resid_post"].shape == (4, 1, 64)

    assert main(["generate", "x", "--model", model, "--hidden-states", "points=nope"]) == 2
    assert "unknown point 'nope'" in capsys.readouterr().err
    assert main(["generate", "--input", str(inp), "--model", model, "--hidden-states", "layers=0"]) == 2
    assert "needs --save DIR" in capsys.readouterr().err


def test_a_step_without_capture_or_steering_builds_no_tap(tiny_models, monkeypatch):
    """Requests that ask for nothing cost nothing: no plan is built and the model gets no tap."""
    import tapllm.engine.step_tap as tap_module

    llm = LLM(tiny_models["llama"], dtype="float32")
    built = []

    def refuse(*args, **kwargs):
        raise AssertionError("a capture or steering plan was built for a step that needs none")

    real_build = tap_module.StepTap.build
    monkeypatch.setattr(tap_module, "CapturePlan", refuse)
    monkeypatch.setattr(tap_module, "SteeringPlan", refuse)
    monkeypatch.setattr(tap_module.StepTap, "build", classmethod(
        lambda cls, *a, **kw: built.append(real_build.__func__(cls, *a, **kw)) or built[-1]))
    out = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert built and all(t is None for t in built)
