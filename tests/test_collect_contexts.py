"""``--dataset`` input pipeline without a model: contexts equal a reference computed with the
tokenizer directly, cursors resume exactly, and a 200k-row stream keeps memory flat."""

from __future__ import annotations

import itertools
import random

import psutil
import pytest

from tapllm.collect.contexts import ContextSettings, Cursor, build_contexts
from tapllm.collect.hf_input import DatasetSpec, documents, open_dataset, tokenize_fn
from tapllm.collect.sources import DatasetSource

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "seven", "quiet", "north", "café", "9"]


def _texts(n: int, seed: int = 0, long_every: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = 300 if long_every and i % long_every == 1 else rng.randint(0, 30)
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)))
    return out


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_folder))


def _reference(tokenizer, texts: list[str], size: int, mode: str, bos: bool, max_records=None, max_tokens=None):
    """The contexts, computed from whole token lists (SAELens' conventions, stated plainly)."""
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[:max_records]]
    b = tokenizer.bos_token_id
    if mode == "packing":
        stream = [tok for d in docs for tok in ([b] if bos else []) + d]
        out, p = [], 0
        while p < len(stream):
            if bos and stream[p] != b:  # BOS first in every context, standing for a separator there
                out.append([b] + stream[p : p + size - 1])
                p += size - 1
            else:
                out.append(stream[p : p + size])
                p += size
    else:
        out = []
        for d in docs:
            if not d and not bos:
                continue
            if bos:
                chunks = [[b] + d[a : a + size - 1] for a in range(0, max(len(d), 1), size - 1)]
            else:
                chunks = [d[a : a + size] for a in range(0, len(d), size)]
            out.extend(chunks[:1] if mode == "truncate" else chunks)
    if max_tokens is not None:
        flat, cut = 0, []
        for c in out:
            if flat >= max_tokens:
                break
            cut.append(c[: max_tokens - flat])
            flat += len(cut[-1])
        out = cut
    return out


def _build(tokenizer, texts, settings, start=Cursor()):
    skip = start.records - 1 if start.carry else start.records
    docs = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[skip:])
    return list(build_contexts(docs, settings, start))


@pytest.mark.parametrize("mode", ["packing", "chunk", "truncate"])
@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
def test_contexts_equal_a_tokenizer_reference(tokenizer, mode, bos):
    texts = _texts(60, seed=1, long_every=17)  # a few documents much longer than a context
    size = 24
    s = ContextSettings(size=size, packing=mode == "packing", truncate=mode == "truncate",
                        bos_token_id=tokenizer.bos_token_id if bos else None)
    got = [c for c, _ in _build(tokenizer, texts, s)]
    assert got == _reference(tokenizer, texts, size, mode, bos)
    assert all(len(c) <= size for c in got)
    if bos:
        assert all(c[0] == tokenizer.bos_token_id for c in got)
    if mode == "packing":
        assert all(len(c) == size for c in got[:-1])  # every context full but the stream's last


def test_a_long_document_is_chunked_exactly(tokenizer):
    text = " ".join(WORDS[i % len(WORDS)] for i in range(700))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    b = tokenizer.bos_token_id
    s = ContextSettings(size=100, bos_token_id=b)
    got = [c for c, _ in _build(tokenizer, [text], s)]
    assert [t for c in got for t in c[1:]] == ids  # every token once, in order, after one BOS each
    assert [len(c) for c in got[:-1]] == [100] * (len(got) - 1) and all(c[0] == b for c in got)
    assert len(got) == -(-len(ids) // 99)


@pytest.mark.parametrize("budget", [("max_records", 23), ("max_tokens", 333)])
@pytest.mark.parametrize("mode", ["packing", "chunk"])
def test_budgets_stop_at_the_limit(tokenizer, budget, mode):
    texts = _texts(60, seed=2, long_every=13)
    kw = {budget[0]: budget[1]}
    s = ContextSettings(size=32, packing=mode == "packing", bos_token_id=tokenizer.bos_token_id, **kw)
    got = [c for c, _ in _build(tokenizer, texts, s)]
    assert got == _reference(tokenizer, texts, 32, mode, True, **kw)
    if budget[0] == "max_tokens":
        assert sum(map(len, got)) == 333


@pytest.mark.parametrize(("mode", "bos"), [("packing", True), ("packing", False), ("chunk", True),
                                           ("truncate", True)])
def test_resuming_from_every_cursor_continues_exactly(tokenizer, mode, bos):
    texts = _texts(40, seed=3, long_every=11)
    s = ContextSettings(size=20, packing=mode == "packing", truncate=mode == "truncate",
                        bos_token_id=tokenizer.bos_token_id if bos else None, max_tokens=900)
    whole = _build(tokenizer, texts, s)
    for k, (_, cursor) in enumerate(whole):
        rest = _build(tokenizer, texts, s, Cursor.from_list(cursor.to_list()))
        assert rest == whole[k + 1 :], f"resuming after context {k} ({cursor})"


def test_dataset_files_stream_through_the_column(tmp_path, tokenizer):
    import datasets

    texts = _texts(50, seed=4)
    rows = [{"id": i, "body": t} for i, t in enumerate(texts)]
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "d.jsonl"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    expect = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for name, split in ((tmp_path / "d.jsonl", "train"), (tmp_path / "d.parquet", "train"),
                        (tmp_path / "dd", "validation")):
        ds = open_dataset(DatasetSpec(str(name), split, "body"))
        assert list(documents(ds, "body", 0, tokenize_fn(tokenizer))) == expect, name
        assert list(documents(ds, "body", 7, tokenize_fn(tokenizer))) == expect[7:], name
    # token ids in the column are taken as they are
    datasets.Dataset.from_list([{"ids": [5, 6, 7]}, {"ids": [8]}]).save_to_disk(str(tmp_path / "tok"))
    ds = open_dataset(DatasetSpec(str(tmp_path / "tok"), column="ids"))
    assert list(documents(ds, "ids", 0, tokenize_fn(tokenizer))) == [[5, 6, 7], [8]]
    with pytest.raises(ValueError, match=r"--column 'text' is not a column of --dataset .* \(columns: \['id', "
                                         r"'body'\]\)"):
        open_dataset(DatasetSpec(str(tmp_path / "d.parquet")))
    with pytest.raises(ValueError, match=r"--split 'train' is not a split of --dataset .* \(splits: "
                                         r"\['validation'\]\)"):
        open_dataset(DatasetSpec(str(tmp_path / "dd"), column="body"))


def test_a_hub_name_not_in_the_cache_is_a_clear_error(monkeypatch, tmp_path):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # hermetic: only the local cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    with pytest.raises(FileNotFoundError, match="--dataset no-such-org/no-such-set: not a local file or folder, "
                                                "and not in the Hugging Face datasets cache"):
        open_dataset(DatasetSpec("no-such-org/no-such-set"))


def test_a_streamed_200k_row_dataset_keeps_memory_flat(tmp_path, tokenizer):
    """The whole pipeline (streamed Parquet -> tokenizer -> packed contexts) of 200k records:
    the memory after the first 10k contexts does not grow with the rest of the input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(5)
    n = 200_000
    words = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for _ in range(1000)]
    texts = pa.array([words[i % 1000] + f" {i}" for i in range(n)])
    pq.write_table(pa.table({"text": texts}), tmp_path / "big.parquet", row_group_size=5000)
    data_bytes = texts.nbytes
    del texts, words
    spec = DatasetSpec(str(tmp_path / "big.parquet"))
    settings = ContextSettings(size=128, packing=True, bos_token_id=tokenizer.bos_token_id)
    source = DatasetSource(open_dataset(spec), spec, settings)
    proc = psutil.Process()
    contexts = tokens = 0
    base = peak = 0
    for _, ctx, _ in source.prompts(0, None, None, tokenizer):
        contexts += 1
        tokens += len(ctx)
        if contexts == 10_000:
            base = proc.memory_info().rss
        elif contexts % 5000 == 0 and base:
            peak = max(peak, proc.memory_info().rss)
    grown = (peak - base) / 2**20
    # ~8M tokens: held as Python lists they would take hundreds of MB, the text alone ~35 MB
    assert tokens > 5_000_000 and data_bytes > 30 * 2**20
    print(f"RSS grew {grown:.1f} MiB after the first 10k contexts")
    assert grown < 24, f"RSS grew {grown:.1f} MiB while streaming"


def test_cursor_round_trips():
    c = Cursor(3, 7, 99)
    assert Cursor.from_list(c.to_list()) == c and Cursor.from_list(None) == Cursor()
    assert list(itertools.islice(build_contexts(iter([]), ContextSettings(size=4)), 1)) == []
