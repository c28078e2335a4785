"""``tapllm collect --recipe eagle3``: the layouts on disk (speculators', SpecForge's, tapllm's),
states equal to ``LLM.encode`` / ``LLM.generate``, loss masks over assistant tokens, token
frequencies and d2t/t2d, regeneration, resume after kill -9, bad input. The peers' own loaders
are exercised by ``benchmarks/eagle3_check.py`` (they are no dependency of the project)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

import tapllm.datasets
from conftest import TINY, save_tiny_model
from helpers import kill_once_written
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.cli import main
from tapllm.collect.chat import normalize, render_fn, tokens_with_mask
from tapllm.collect.vocab import count_tokens, draft_mapping, frequency_dict

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "seven", "quiet", "north"]


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory, default_model_folder) -> Path:
    """A tiny Llama of 8 blocks: EAGLE-3's default aux layers are then 2, 4, 5."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, **{**TINY, "num_hidden_layers": 8})
    return save_tiny_model(tmp_path_factory.mktemp("tiny8") / "m", cfg, default_model_folder)


def _conversations(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g))

    out = []
    for i in range(n):
        if i % 3 == 0:  # ShareGPT
            turns = [{"from": "human", "value": words(3 + i % 7)}, {"from": "gpt", "value": words(2 + i % 5)}]
            out.append({"conversations": turns})
        elif i % 3 == 1:  # UltraChat 200k, two exchanges and a system turn
            out.append({"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": words(4)}, {"role": "assistant", "content": words(3)},
                                     {"role": "user", "content": words(2)}, {"role": "assistant", "content": words(5)}]})
        else:  # UltraChat's first release
            out.append({"data": [words(5), words(4)]})
    return out


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _collect(model: Path, inp: Path, out: Path, *extra: str) -> int:
    return main(["collect", "--recipe", "eagle3", "--model", str(model), "--input", str(inp), "--out", str(out),
                 "--dtype", "float32", "--quiet", *extra])


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_folder))


def test_layouts_and_masks_of_conversations(tokenizer):
    sharegpt = normalize({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
                                            {"from": "gpt", "value": "hello you"}]}, "r")
    assert sharegpt == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello you"}]
    assert normalize({"data": ["a", "b", "c"]}, "r")[2] == {"role": "user", "content": "c"}
    assert normalize({"messages": json.dumps([{"role": "user", "content": "x"}])}, "r") == [
        {"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match=r"f:3: needs one of the fields"):
        normalize({"text": "plain"}, "f:3")
    with pytest.raises(ValueError, match=r"r conversations\[0\]: role 'robot' is not one of"):
        normalize({"conversations": [{"from": "robot", "value": "x"}]}, "r")

    def render_chat(messages, add_generation_prompt):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    render = render_fn(render_chat, tokenizer)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two"},
            {"role": "assistant", "content": "three four"}, {"role": "user", "content": "five"},
            {"role": "assistant", "content": "six seven eight"}]
    tok = tokens_with_mask(conv, render)
    assert tok.ids == tokenizer.encode(tokenizer.apply_chat_template(conv, tokenize=False), add_special_tokens=False)
    kept = [t for t, m in zip(tok.ids, tok.mask) if m]
    # the replies and their end-of-turn markers, nothing else (ChatML)
    assert tokenizer.decode(kept) == "three four<|im_end|>\nsix seven eight<|im_end|>\n"
    tail = tokens_with_mask(conv[:4], render, generation_prompt=True)
    assert tokenizer.decode(tail.ids).endswith("<|im_start|>assistant\n") and tail.mask[-3:] == [0, 0, 0]
    assert tokenizer.decode([t for t, m in zip(tail.ids, tail.mask) if m]) == "three four<|im_end|>\n"


def test_draft_vocabulary_mapping_as_speculators_builds_it():
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(500, dtype=torch.long)
    ids = torch.randint(0, 120, (4000,), generator=g)
    mask = torch.rand(4000, generator=g) < 0.7
    count_tokens(counts, ids, mask)
    assert int(counts.sum()) == int(mask.sum())
    freq = frequency_dict(counts)
    assert freq == {int(k): int(v) for k, v in zip(*ids[mask].unique(return_counts=True))}
    for size in (50, 300):  # fewer seen than asked: topped up with the smallest unused ids
        ranked = sorted(freq, key=lambda t: (-freq[t], t))[:size]
        ranked += [t for t in range(size) if t not in ranked][: size - len(ranked)]
        chosen = sorted(ranked[:size])
        d2t, t2d = draft_mapping(counts, size)
        assert (torch.arange(size) + d2t).tolist() == chosen
        assert torch.nonzero(t2d).flatten().tolist() == chosen and t2d.dtype == torch.bool
    with pytest.raises(ValueError, match="draft-vocab-size must be in"):
        draft_mapping(counts, 501)


def test_eagle3_layouts_hold_the_states_of_encode(tiny8, tmp_path):
    records = _conversations(12)
    inp = _write(tmp_path / "chats.jsonl", records)
    out = tmp_path / "e3"
    assert _collect(tiny8, inp, out, "--eagle3-formats", "speculators,specforge,tapllm", "--shard-tokens", "150",
                    "--draft-vocab-size", "100") == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["layers"] == [1, 3, 4, 7] and meta["eagle3"]["aux_layers"] == [2, 4, 5] and meta["num_shards"] > 2
    llm = LLM(tiny8, dtype="float32")
    tok = llm.tokenizer
    render = render_fn(llm.apply_chat_template, tok)
    convs = [normalize(r, "t") for r in records]
    expected = [tokens_with_mask(c, render) for c in convs]
    spec = HiddenStatesSpec(layers=[1, 3, 4, 7], points=["resid_post", "final"], positions="prompt")
    refs = llm.encode([e.ids for e in expected], spec, use_tqdm=False)

    import datasets
    from safetensors.torch import load_file

    rows = datasets.load_from_disk(str(out / "speculators"))
    assert rows.column_names == ["input_ids", "loss_mask", "seq_len"] and rows.format["type"] == "torch"
    counts = torch.zeros(49152, dtype=torch.long)
    for i, (e, ref) in enumerate(zip(expected, refs)):
        r = rows[i]
        assert r["input_ids"].tolist() == e.ids and r["loss_mask"].tolist() == e.mask and int(r["seq_len"]) == len(e.ids)
        assert r["input_ids"].dtype == r["loss_mask"].dtype == torch.int64
        hs = load_file(out / "speculators" / "hidden_states" / f"hs_{i}.safetensors")
        assert set(hs) == {"hidden_states", "token_ids"} and hs["token_ids"].tolist() == e.ids
        assert hs["hidden_states"].shape == (len(e.ids), 4, 64) and hs["hidden_states"].dtype == torch.float32
        torch.testing.assert_close(hs["hidden_states"], ref.hidden_states["resid_post"], atol=1e-5, rtol=1e-5)
        sf = torch.load(out / "specforge" / "rows_0-2000" / f"data_{i}.ckpt")
        assert set(sf) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert sf["input_ids"].tolist() == e.ids and sf["loss_mask"].tolist() == e.mask
        assert sf["aux_hidden_state"].shape == (1, len(e.ids), 3 * 64) and sf["hidden_state"].shape == (1, len(e.ids), 64)
        assert torch.equal(sf["aux_hidden_state"][0], hs["hidden_states"][:, :3].reshape(len(e.ids), -1))
        torch.testing.assert_close(sf["hidden_state"][0], ref.hidden_states["final"][:, 0], atol=1e-5, rtol=1e-5)
        count_tokens(counts, torch.tensor(e.ids), torch.tensor(e.mask))
    assert sum(e.mask[-1] for e in expected) > 0  # replies end the conversations: their tokens are supervised
    freq = torch.load(out / "speculators" / "token_freq.pt")
    assert freq == frequency_dict(counts)
    import numpy as np

    d2t, t2d = draft_mapping(counts, 100)
    assert np.array_equal(np.load(out / "speculators" / "d2t-100.npy"), d2t.numpy())
    assert np.array_equal(np.load(out / "speculators" / "t2d-100.npy"), t2d.numpy())
    vm = torch.load(out / "specforge" / "vocab_mapping.pt")
    assert torch.equal(vm["d2t"], d2t) and torch.equal(vm["t2d"], t2d)
    ds = tapllm.datasets.open(out)  # the tapllm layout: the run's own shards, with loss_mask
    ds.verify()
    assert len(ds) == sum(len(e.ids) for e in expected)
    batch = ds[:]
    assert batch["loss_mask"].tolist() == [m for e in expected for m in e.mask]
    assert batch["resid_post"].shape == (len(ds), 4, 64) and batch["final"].shape == (len(ds), 1, 64)

    from tapllm.collect.eagle3_part import conversation_states

    mem = conversation_states(llm, records[:3])  # the same rows from an LLM, in memory
    for i, r in enumerate(mem):
        assert r["token_id"].tolist() == expected[i].ids and r["loss_mask"].tolist() == expected[i].mask
        torch.testing.assert_close(r["resid_post"], refs[i].hidden_states["resid_post"], atol=1e-5, rtol=1e-5)


def test_regenerated_replies_are_the_models(tiny8, tmp_path):
    records = [{"conversations": [{"from": "human", "value": "alpha beta"}, {"from": "gpt", "value": "old"},
                                  {"from": "human", "value": "gamma"}, {"from": "gpt", "value": "old too"}]},
               {"messages": [{"role": "user", "content": "river stone light"}]},  # ends with the user: replied to
               {"data": ["north", "x"]}]
    inp = _write(tmp_path / "chats.jsonl", records)
    out = tmp_path / "regen"
    assert _collect(tiny8, inp, out, "--regenerate", "--max-tokens", "6", "--eagle3-formats", "speculators") == 0
    assert not (out / "specforge").exists()
    llm = LLM(tiny8, dtype="float32", batch_invariant=True)  # as the recipe runs it (its default)
    render = render_fn(llm.apply_chat_template, llm.tokenizer)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    first = llm.generate([render([{"role": "user", "content": "alpha beta"}], True)], greedy, use_tqdm=False)[0]
    history = [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": first.outputs[0].text},
               {"role": "user", "content": "gamma"}]
    histories = [history, [{"role": "user", "content": "river stone light"}], [{"role": "user", "content": "north"}]]
    prompts = [tokens_with_mask(h, render, generation_prompt=True) for h in histories]
    spec = HiddenStatesSpec(layers=[1, 3, 4, 7], points=["resid_post"], positions="all")
    refs = llm.generate([p.ids for p in prompts], SamplingParams(max_tokens=6, temperature=0, hidden_states=spec),
                        use_tqdm=False)
    import datasets
    from safetensors.torch import load_file

    rows = datasets.load_from_disk(str(out / "speculators"))
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        gen = list(ref.outputs[0].token_ids)
        seq = (p.ids + gen)[:-1]  # the last sampled token is never run through the model
        assert rows[i]["input_ids"].tolist() == seq
        assert rows[i]["loss_mask"].tolist() == p.mask + [1] * (len(gen) - 1)
        hs = load_file(out / "speculators" / "hidden_states" / f"hs_{i}.safetensors")
        torch.testing.assert_close(hs["hidden_states"], ref.hidden_states["resid_post"], atol=1e-5, rtol=1e-5)
    assert sum(prompts[0].mask) > 0  # the first, regenerated, reply is in the history and supervised


def _tree_digests(out: Path) -> dict[str, str]:
    skip = {"metadata.json", "collect.lock"}
    return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(out.rglob("*")) if f.is_file() and f.name not in skip}


def test_kill_mid_run_then_resume_gives_identical_files(tiny8, tmp_path):
    inp = _write(tmp_path / "chats.jsonl", _conversations(30, seed=4))
    args = ["--shard-tokens", "120", "--max-num-seqs", "4", "--eagle3-formats", "speculators,specforge,tapllm",
            "--store-dtype", "bfloat16"]
    whole = tmp_path / "whole"
    assert _collect(tiny8, inp, whole, *args) == 0
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "tapllm", "collect", "--recipe", "eagle3", "--model", str(tiny8), "--input", str(inp),
           "--out", str(cut), "--dtype", "float32", "--quiet", *args]
    manifest = cut / "progress-part000.jsonl"
    kill_once_written(cmd, manifest, 2)
    assert not (cut / "metadata.json").exists()
    assert _collect(tiny8, inp, cut, *args) == 0
    a, b = _tree_digests(whole), _tree_digests(cut)
    assert a.keys() == b.keys() and a == b
    assert any(k.startswith("speculators/hidden_states/") for k in a) and "specforge/vocab_mapping.pt" in a


def test_bad_recipe_input_gets_clear_errors(tiny8, tmp_path, capsys):
    good = _write(tmp_path / "good.jsonl", _conversations(3))

    def err(*args: str) -> str:
        assert _collect(tiny8, *args) == 2
        return capsys.readouterr().err

    bad = _write(tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "x"}]}, {"text": "no"}])
    assert "bad.jsonl:2: needs one of the fields" in err(bad, tmp_path / "o1")
    assert "--aux-layers [2, 4, 9]: each must be in [1, 7]" in err(good, tmp_path / "o2", "--aux-layers", "2,4,9")
    assert "--aux-layers must name 3 layers" in err(good, tmp_path / "o3", "--aux-layers", "2,4")
    assert "--eagle3-formats must name some of" in err(good, tmp_path / "o4", "--eagle3-formats", "megatron")
    assert "--packing do not apply to --recipe eagle3" in err(good, tmp_path / "o5", "--packing")


def test_the_command_line_names_the_recipes_layouts():
    from tapllm.collect import eagle3, eagle3_cli

    assert eagle3_cli.FORMATS == eagle3.FORMATS
