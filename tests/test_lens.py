"""The logit lens equals transformers' final norm + unembedding on the same states; pictures are real files."""

from __future__ import annotations

import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch

from conftest import random_prompts
from family_harness import hf_points
from tapllm import LLM, HiddenStates, HiddenStatesSpec, SamplingParams
from tapllm.hidden_states.json_codec import hidden_states_from_wire, hidden_states_to_wire
from test_family_llama import LAYOUT

K = 4
TARGETS = [100, 2000, 31000]


@pytest.fixture(scope="module")
def setup(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama3-rope-tied"], dtype=torch.float32).eval()
    return LLM(tiny_models["llama3-rope-tied"], dtype="float32", max_num_batched_tokens=9), model


def _hf_lens(model, states: torch.Tensor, normed: bool):
    with torch.no_grad():
        x = states if normed else model.model.norm(states)
        lp = model.lm_head(x).float().log_softmax(-1)
    vals, ids = lp.topk(K, dim=-1)
    return ids, vals, lp[..., TARGETS]


def test_lens_equals_transformers_at_every_point(setup):
    llm, model = setup
    prompts = random_prompts([6, 21], seed=17)
    spec = HiddenStatesSpec(layers="all", points=["embed", "resid_pre", "resid_mid", "resid_post", "final",
                                                  "attn_out"], positions="all", lens=K, lens_targets=TARGETS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, hidden_states=spec),
                        use_tqdm=False)  # batched and chunked (budget 9)
    for prompt, out in zip(prompts, outs):
        seq = (prompt + out.outputs[0].token_ids)[:-1]
        ref = hf_points(model, LAYOUT, seq)
        lens = out.hidden_states.lens
        assert set(lens) == {"embed", "resid_pre", "resid_mid", "resid_post", "final"}  # not attn_out
        for point in lens:
            ids, vals, tgt = _hf_lens(model, ref[point], normed=point == "final")
            got = lens[point]
            assert got.token_ids.shape == (len(seq), ref[point].shape[1], K)
            assert torch.equal(got.token_ids[:, :, 0], ids[:, :, 0]), point
            assert float((got.logprobs - vals).abs().max()) < 1e-4, point
            assert float((got.target_logprobs - tgt).abs().max()) < 1e-4, point


def test_lens_of_reduced_and_last_states(setup):
    llm, model = setup
    prompt = random_prompts([15], seed=18)[0]
    mean = llm.encode([prompt], dict(layers=[0, 2], points="resid_post", reduce="mean", lens=K))[0].hidden_states
    states = hf_points(model, LAYOUT, prompt)["resid_post"][:, [0, 2]]
    ids, vals, _ = _hf_lens(model, states.mean(0), normed=False)
    assert mean.lens.token_ids.shape == (2, K) and torch.equal(mean.lens.token_ids, ids)
    assert float((mean.lens.logprobs - vals).abs().max()) < 1e-4
    last = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, hidden_states=dict(
        layers=[1], points="resid_post", positions="last", lens=K)), use_tqdm=False)[0]
    seq = (prompt + last.outputs[0].token_ids)[:-1]
    ids, vals, _ = _hf_lens(model, hf_points(model, LAYOUT, seq)["resid_post"][-1:, [1]], normed=False)
    assert last.hidden_states.lens.token_ids.shape == (1, 1, K)
    assert torch.equal(last.hidden_states.lens.token_ids, ids)


def test_lens_survives_files_and_the_wire(setup, tmp_path):
    llm, _ = setup
    hs = llm.encode(random_prompts([9], seed=19), dict(layers=[0, 1], lens=2, lens_targets=[5]))[0].hidden_states
    for back in (HiddenStates.load(hs.save(tmp_path / "s.safetensors")),
                 hidden_states_from_wire(hidden_states_to_wire(hs, "base64")),
                 hidden_states_from_wire(hidden_states_to_wire(hs, "list"))):
        assert back.lens.targets == [5]
        assert torch.equal(back.lens.token_ids, hs.lens.token_ids)
        assert torch.allclose(back.lens.logprobs, hs.lens.logprobs)
        assert torch.allclose(back.lens.target_logprobs, hs.lens.target_logprobs)


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.cells = 0

    def handle_starttag(self, tag, attrs) -> None:
        self.cells += tag == "td"


def test_pictures_are_real_files(setup, tmp_path, tiny_models):
    import matplotlib.image

    llm, _ = setup
    prompt = random_prompts([7], seed=20)[0]
    hs = llm.encode([prompt], dict(layers="all", lens=3))[0].hidden_states
    png = hs.plot_lens(tmp_path / "lens.png", tokenizer=llm.tokenizer, input_tokens=prompt)
    image = matplotlib.image.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.shape[0] >= 300 and image.shape[1] >= 600  # at least the 6 x 3 inch figure at 100 dpi
    page = hs.plot_lens(tmp_path / "lens.html", tokenizer=llm.tokenizer, input_tokens=prompt)
    parser = _Cells()
    parser.feed(page.read_text())
    assert parser.cells == 3 * 7  # layers x positions
    norms = matplotlib.image.imread(hs.plot_norms(tmp_path / "norms.png"))
    assert norms.shape[:2] == (400, 700)
    r = subprocess.run([sys.executable, "-m", "tapllm", "lens", "one two three four", "--model",
                        str(tiny_models["llama"]), "--png", str(tmp_path / "c.png"), "--html", str(tmp_path / "c.html"),
                        "--layers", "0,-1", "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resid_post 2" in r.stdout and "resid_post 0" in r.stdout
    assert (tmp_path / "c.png").stat().st_size > 1000 and "<table>" in (tmp_path / "c.html").read_text()


@pytest.mark.parametrize("kwargs, message", [
    (dict(lens=0), "lens must be an integer"),
    (dict(lens=101), "lens must be an integer"),
    (dict(lens=2, points=["attn_out"]), "residual-stream point"),
    (dict(lens=2, project=torch.randn(2, 64)), "cannot be combined with project"),
    (dict(lens_targets=[-1]), "lens_targets"),
])
def test_bad_lens_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiddenStatesSpec(**kwargs)


def test_lens_target_outside_the_vocabulary(setup):
    llm, _ = setup
    with pytest.raises(ValueError, match=r"lens_targets.*\[0, 49152\)"):
        llm.encode([[5, 6, 7]], dict(lens=1, lens_targets=[49152]))
