"""Reductions, projections and reducer plugins equal the same maths on the full per-token states."""

from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import random_prompts
from helpers import assert_close
from tapllm import LLM, HiddenStatesSpec, SamplingParams, register_reducer
from tapllm.hidden_states import available_reducers

NEW = 6
BASE = dict(layers=[0, 1, -1], points=["resid_post", "final"], positions="all")
TORCH_REDUCE = {
    "mean": lambda t: t.mean(0),
    "sum": lambda t: t.sum(0),
    "max": lambda t: t.amax(0),
    "min": lambda t: t.amin(0),
    "first": lambda t: t[0],
    "last": lambda t: t[-1],
}


def _run(llm: LLM, prompts, **spec) -> list:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, hidden_states=HiddenStatesSpec(**spec))
    return [o.hidden_states for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def setup(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    chunked = LLM(tiny_models["llama"], dtype="float32", max_num_batched_tokens=5, enable_prefix_caching=False)
    prompts = random_prompts([1, 13, 29], seed=4)
    full = _run(llm, prompts, **BASE)
    return llm, chunked, prompts, full


@pytest.mark.parametrize("name", sorted(TORCH_REDUCE))
def test_builtin_reduction_equals_torch_on_full_states(name, setup):
    llm, chunked, prompts, full = setup
    for engine in (llm, chunked):  # the result must not depend on how the prompt was chunked
        for hs, ref in zip(_run(engine, prompts, **BASE, reduce=name), full):
            assert hs.reduce == name and hs.positions.tolist() == ref.positions.tolist()
            for point in ("resid_post", "final"):
                assert_close(hs[point], TORCH_REDUCE[name](ref[point]))


def test_reduction_over_windows_and_numpy(setup):
    llm, chunked, prompts, _ = setup
    p = prompts[2]
    prompt_only = _run(llm, [p], **{**BASE, "positions": "prompt"})[0]
    for engine in (llm, chunked):
        hs = _run(engine, [p], **{**BASE, "positions": "prompt", "reduce": "mean"})[0]
        assert_close(hs["resid_post"], torch.from_numpy(prompt_only["resid_post"].numpy().mean(axis=0)))
        win = _run(engine, [p], **{**BASE, "positions": (4, 31), "reduce": "max"})[0]
        assert win.positions.tolist() == list(range(4, 31))
        gen = _run(llm, [p], **{**BASE, "positions": "all"})[0]
        assert_close(win["final"], gen["final"][4:31].amax(0))
    last = _run(llm, [p], **{**BASE, "positions": "last"})[0]
    assert last.positions.tolist() == [len(p) + NEW - 2] and last["final"].shape == (1, 1, 64)
    last_prompt = _run(llm, [p], **{**BASE, "positions": "last_prompt", "reduce": "first"})[0]
    assert_close(last_prompt["final"], prompt_only["final"][-1])


def test_projection_equals_states_times_directions(setup):
    llm, chunked, prompts, full = setup
    dirs = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    for hs, ref in zip(_run(chunked, prompts, **BASE, project=dirs), full):
        assert hs["resid_post"].shape == (ref["resid_post"].shape[0], 3, 4)
        for point in ("resid_post", "final"):
            assert_close(hs[point], ref[point] @ dirs.T)
    for hs, ref in zip(_run(llm, prompts, **BASE, project=dirs, reduce="mean"), full):
        assert_close(hs["resid_post"], (ref["resid_post"] @ dirs.T).mean(0))
    # a list of lists works too (as a server would send it), and dtype applies to the result
    hs = _run(llm, prompts[:1], **BASE, project=dirs.tolist(), dtype="bfloat16")[0]
    assert hs["final"].dtype == torch.bfloat16 and hs["final"].shape[-1] == 4


class RmsReducer:
    """Root mean square over positions: a plugin-style reducer written against the protocol."""

    def start(self, num_layers: int, width: int, device: torch.device) -> None:
        self.sq = torch.zeros(num_layers, width, device=device)
        self.n = 0

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        self.sq += rows.pow(2).sum(0)
        self.n += rows.shape[0]

    def finish(self) -> torch.Tensor:
        return (self.sq / self.n).sqrt()


def test_reducer_registered_in_code(setup):
    llm, chunked, prompts, full = setup
    register_reducer("test-rms", RmsReducer)
    for engine in (llm, chunked):
        for hs, ref in zip(_run(engine, prompts, **BASE, reduce="test-rms"), full):
            assert_close(hs["resid_post"], ref["resid_post"].pow(2).mean(0).sqrt())
    with pytest.raises(ValueError, match="built-in"):
        register_reducer("mean", RmsReducer)


def test_plugin_discovered_through_entry_point(setup, tmp_path, monkeypatch):
    """A package declaring a ``tapllm.reducers`` entry point is found and run in the engine."""
    llm, chunked, prompts, full = setup
    pkg = tmp_path / "tapllm_absmax_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import torch

        class AbsMax:
            def start(self, num_layers, width, device):
                self.m = None

            def update(self, rows, positions):
                a = rows.abs().amax(0)
                self.m = a if self.m is None else torch.maximum(self.m, a)

            def finish(self):
                return self.m
    """))
    dist = tmp_path / "tapllm_absmax_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tapllm-absmax-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tapllm.reducers]\nabsmax = tapllm_absmax_plugin:AbsMax\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "absmax" in available_reducers()
    for engine in (llm, chunked):
        for hs, ref in zip(_run(engine, prompts, **BASE, reduce="absmax"), full):
            assert_close(hs["final"], ref["final"].abs().amax(0))


@pytest.mark.parametrize("name", ["mean", "sum", "max", "min", "first", "last"])
def test_folded_chunks_equal_rows(name):
    """A built-in fed chunks folded to one row each (``Folds.apply``, then ``fold_in``: what tensor parallelism
    gathers) gives what it gives fed the chunks' rows, after rows it already holds."""
    from tapllm.hidden_states.plan import Folds
    from tapllm.hidden_states.reducers import BUILTIN_REDUCERS

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(150, 2, 24, generator=g)
    cuts = [0, 7, 70, 71, 150]
    a, b = BUILTIN_REDUCERS[name](), BUILTIN_REDUCERS[name]()
    for r in (a, b):
        r.start(2, 24, torch.device("cpu"))
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        chunk = rows[lo:hi]
        a.update(chunk, torch.arange(lo, hi))
        if i == 0:  # rows first, then folded chunks
            b.update(chunk, torch.arange(lo, hi))
        else:
            folded = Folds(((0, hi - lo),), (b.fold_kind,)).apply(chunk)
            b.fold_in(folded[0], hi - lo)
    torch.testing.assert_close(b.finish(), a.finish(), rtol=1e-6, atol=1e-5)
