"""Shuffled reads of collected datasets (``tapllm.collect.readers``): token, block and context
units, the shuffle buffer across shards, column and layer selection, ``DataLoader`` workers,
epochs, Arrow shards of many record batches; the SAELens activation source; and the SAE
latents of a ``--sae`` collection read back as evaluation data (dense, sparse, statistics, top
examples) against a reference computed from the stored states with the SAE itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import tapllm.datasets
from conftest import TINY, random_prompts, save_tiny_model
from tapllm.cli import main
from tapllm.collect.readers import ShuffledBatches
from tapllm.collect.sae_latents import SAELatents
from tapllm.collect.saelens_source import SAELensSource
from test_sae import write_saelens

LENGTHS = [23, 5, 41, 17, 60, 9, 33, 12, 28, 50, 7, 19, 36, 14, 44, 25]


def _collect(model: Path, inp: Path, out: Path, *extra: str) -> None:
    assert main(["collect", "--model", str(model), "--input", str(inp), "--out", str(out), "--dtype", "float32",
                 "--quiet", *extra]) == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_folder) -> Path:
    """A tiny Llama of 3 blocks (only this one: the session's family of tiny models is not needed)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, **TINY)
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", cfg, default_model_folder)


@pytest.fixture(scope="module")
def datasets(tiny, tmp_path_factory, monkeypatch_module) -> dict[str, Path]:
    """One collection in each format: 16 prompts, blocks 0 and 2, shards of about 100 rows;
    the Arrow shards cut into record batches of 16 rows, so reads cross chunk boundaries."""
    import tapllm.collect.shards as shards

    root = tmp_path_factory.mktemp("reads")
    inp = root / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in random_prompts(LENGTHS, seed=2)))
    out = {}
    for fmt in ("safetensors", "arrow"):
        if fmt == "arrow":  # 64 MB // this = 16 rows a record batch
            monkeypatch_module.setattr(shards, "_row_bytes", lambda columns: (64 << 20) // 16)
        out[fmt] = root / fmt
        _collect(tiny, inp, out[fmt], "--layers", "0,2", "--points", "resid_post,mlp_out",
                 "--shard-tokens", "100", "--format", fmt)
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _key(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["request_index"] * 1000 + batch["position"]


def _runs(keys: torch.Tensor) -> list[torch.Tensor]:
    """``keys`` cut where they stop being consecutive rows of one request."""
    cut = torch.nonzero(keys[1:] != keys[:-1] + 1).flatten() + 1
    return list(torch.tensor_split(keys, cut.tolist()))


@pytest.mark.parametrize("fmt", ["safetensors", "arrow"])
def test_every_unit_reads_every_row_once_with_its_values(datasets, fmt):
    ds = tapllm.datasets.open(datasets[fmt])
    full = ds[:]
    where = {int(k): i for i, k in enumerate(_key(full))}
    n = len(ds)
    assert ds.metadata["num_shards"] >= 4 and n == sum(LENGTHS)
    if fmt == "arrow":
        assert len(ds.view(0).columns["resid_post"].chunks) > 1
    for unit, extra in [("token", {}), ("block", {"block_rows": 8}), ("context", {}),
                        ("block", {"block_rows": 8, "shuffle_buffer": 100}), ("context", {"shuffle_buffer": 150})]:
        reader = ShuffledBatches(ds, 64, unit, seed=3, **extra)
        batches = list(DataLoader(reader, batch_size=None))
        assert len(batches) == len(reader) == -(-n // 64)
        assert [len(b["position"]) for b in batches[:-1]] == [64] * (len(batches) - 1)
        keys = torch.cat([_key(b) for b in batches])
        assert sorted(keys.tolist()) == sorted(where), (unit, extra)  # every row once
        assert not torch.equal(keys, _key(full))
        rows = torch.tensor([where[int(k)] for k in keys])
        got = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        for k, v in full.items():
            assert torch.equal(got[k], v[rows]), (unit, k)
        if "shuffle_buffer" in extra:  # rows of several shards in one batch
            shard_of = np.searchsorted(np.cumsum([s["rows"] for s in ds.shards]), rows[:64].numpy(), side="right")
            assert len(set(shard_of.tolist())) >= 2
        elif unit != "token":  # the batches, end to end, are the units (whole contexts; aligned blocks) in some order
            starts = np.cumsum([0] + [sh["rows"] for sh in ds.shards])
            units = {int(starts[s] + a): int(e - a) for s, a, e in reader.units().tolist()}
            if unit == "context":
                assert sorted(units.values()) == sorted(LENGTHS)
            else:
                local = [g - starts[np.searchsorted(starts, g, side="right") - 1] for g in units]
                assert max(units.values()) == 8 and all(a % 8 == 0 for a in local)
            p, seen = 0, set()
            while p < len(rows):
                first = int(rows[p])
                assert first in units and first not in seen
                seen.add(first)
                assert torch.equal(rows[p : p + units[first]], torch.arange(first, first + units[first]))
                p += units[first]
            assert seen == set(units)


def test_orders_epochs_workers_columns_and_layers(datasets):
    ds = tapllm.datasets.open(datasets["safetensors"])
    n = len(ds)

    def keys(reader, **kw) -> torch.Tensor:
        return torch.cat([_key(b) for b in DataLoader(reader, batch_size=None, **kw)])

    a = ShuffledBatches(ds, 50, "context", seed=1)
    first = keys(a)
    assert torch.equal(first, keys(ShuffledBatches(ds, 50, "context", seed=1)))  # a seed gives one order
    a.set_epoch(1)
    assert not torch.equal(first, keys(a))
    two = keys(ShuffledBatches(ds, 50, "token", seed=1), num_workers=2)
    assert sorted(two.tolist()) == sorted(_key(ds[:]).tolist())
    dropped = list(ShuffledBatches(ds, 64, "block", drop_last=True))
    assert len(dropped) == n // 64 and all(len(b["position"]) == 64 for b in dropped)
    # only the columns and blocks asked for, equal to the full rows
    sel = next(iter(ShuffledBatches(ds, 40, "token", columns=["mlp_out", "position", "request_index"], layers=[2])))
    assert set(sel) == {"mlp_out", "position", "request_index"} and sel["mlp_out"].shape == (40, 1, 64)
    full = ds[:]
    rows = torch.tensor([{int(k): i for i, k in enumerate(_key(full))}[int(k)] for k in _key(sel)])
    assert torch.equal(sel["mlp_out"], full["mlp_out"][rows][:, 1:])
    with pytest.raises(ValueError, match="unit must be one of"):
        ShuffledBatches(ds, 8, "row")
    with pytest.raises(ValueError, match="shuffle_buffer applies to unit='block' or 'context'"):
        ShuffledBatches(ds, 8, "token", shuffle_buffer=100)
    with pytest.raises(ValueError, match=r"layers must name some of the dataset's layers \[0, 2\], got \[1\]"):
        ShuffledBatches(ds, 8, layers=[1])
    with pytest.raises(ValueError, match="columns must name some of"):
        ShuffledBatches(ds, 8, columns=["resid_pre"])
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ShuffledBatches(ds, 0)


def test_saelens_source_feeds_endless_batches_of_one_layer(datasets):
    ds = tapllm.datasets.open(datasets["safetensors"])
    full = ds[:]
    where = {int(k): i for i, k in enumerate(_key(full))}
    src = SAELensSource(ds, point="resid_post", layer=2, batch_size=96, unit="context", shuffle_buffer=200)
    per_epoch = len(ds) // 96
    batches = [next(src) for _ in range(per_epoch + 2)]  # into a second epoch, as SAELens' store goes on
    assert src.epoch == 2 and all(b.shape == (96, 64) and b.dtype == torch.float32 for b in batches)
    # the first epoch's rows are distinct rows of the dataset's block 2
    table = {tuple(full["resid_post"][i, 1].tolist()): i for i in range(len(ds))}
    seen = [table[tuple(r.tolist())] for b in batches[:per_epoch] for r in b]
    assert len(set(seen)) == len(seen) == per_epoch * 96 and max(seen) < len(where)
    assert len(list(SAELensSource(ds, "resid_post", 0, 96, epochs=1))) == per_epoch
    with pytest.raises(ValueError, match=r"layer: the dataset holds blocks \[0, 2\]; name one"):
        SAELensSource(ds, point="resid_post")
    with pytest.raises(ValueError, match="point must be one of the dataset's points"):
        SAELensSource(ds, point="attn_out", layer=0)
    with pytest.raises(ValueError, match="batch_size 100000 is more than the dataset's"):
        SAELensSource(ds, "resid_post", 0, 100000)


def test_sae_latents_as_evaluation_data(tiny, tmp_path):
    from tapllm import SAE

    folder = write_saelens(tmp_path / "s", "standard", hook="blocks.2.hook_resid_post")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in random_prompts([30, 22, 41], seed=5)))
    out = tmp_path / "acts"
    _collect(tiny, inp, out, "--layers", "2", "--points", "resid_post", "--sae", str(folder),
             "--sae-top", "8", "--shard-tokens", "40")
    lat = SAELatents(out)
    assert lat.d_sae == 256 and lat.top == 8 and lat.sae["layer"] == 2 and len(lat) == 93
    # the reference: the SAE itself on the stored states
    sae = SAE.load(folder)
    x = tapllm.datasets.open(out)[:]["resid_post"][:, 0]
    z = sae.encode(x)
    top = z.topk(8, dim=1)
    ref_dense = torch.zeros_like(z).scatter(1, top.indices, top.values)
    b = lat.batch(range(len(lat)))
    torch.testing.assert_close(b.dense(), ref_dense, atol=1e-5, rtol=1e-5)
    assert torch.equal(b.sparse().to_dense(), b.dense())
    assert b.sparse().values().numel() == int((ref_dense != 0).sum())
    torch.testing.assert_close(b.error_norm, (x - sae.decode(z)).norm(dim=1), atol=1e-4, rtol=1e-4)
    parts = list(lat.iter_batches(25))
    assert max(len(p) for p in parts) <= 25 and sum(len(p) for p in parts) == len(lat)
    assert torch.equal(torch.cat([p.ids for p in parts]), b.ids)
    s = lat.stats(batch_size=25)
    fired = ref_dense != 0
    assert s.rows == 93 and torch.equal(s.fires, fired.sum(0))
    torch.testing.assert_close(s.density, fired.float().mean(0))
    ref_mean = torch.where(fired.any(0), ref_dense.sum(0) / fired.sum(0).clamp(min=1), torch.zeros(256))
    torch.testing.assert_close(s.mean_value, ref_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.max_value, ref_dense.max(0).values, atol=1e-5, rtol=1e-5)
    assert s.mean_l0 == pytest.approx(float(fired.sum(1).float().mean()))
    assert s.saturated == pytest.approx(float((fired.sum(1) == 8).float().mean()))
    assert s.dead == int((~fired.any(0)).sum())
    err = (x - sae.decode(z)).double()
    assert s.mse == pytest.approx(float(err.pow(2).sum(1).mean()), rel=1e-4)
    assert s.fvu == pytest.approx(float(err.pow(2).sum() / (x.double() - x.double().mean(0)).pow(2).sum()), rel=1e-4)
    feature = int(fired.sum(0).argmax())
    ex = lat.top_examples(feature, n=5, batch_size=25)
    want = ref_dense[:, feature].topk(5)
    torch.testing.assert_close(ex.dense()[:, feature], want.values)
    full = tapllm.datasets.open(out)[:]
    assert torch.equal(ex.position, full["position"][want.indices])
    with pytest.raises(ValueError, match="holds no SAE latents"):
        SAELatents(_no_sae(tmp_path, tiny))


def _no_sae(tmp_path: Path, tiny: Path) -> Path:
    inp = tmp_path / "plain.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    _collect(tiny, inp, tmp_path / "plain", "--layers", "1")
    return tmp_path / "plain"


@pytest.mark.parametrize("fmt", ["safetensors", "arrow"])
def test_a_shuffled_copy_holds_every_row_once(datasets, tmp_path, fmt):
    from tapllm.collect.reshuffle import write_shuffled

    src = tapllm.datasets.open(datasets[fmt])
    out = write_shuffled(src, tmp_path / "copy", unit="token", seed=4, shard_rows=150)
    copy = tapllm.datasets.open(out)
    copy.verify()
    assert copy.metadata["shuffled"]["unit"] == "token" and copy.metadata["num_shards"] == 3
    assert copy.metadata["layers"] == src.metadata["layers"] and [s["rows"] for s in copy.shards] == [150, 150, 123]
    a, b = src[:], copy[:]
    where = {int(k): i for i, k in enumerate(_key(a))}
    rows = torch.tensor([where[int(k)] for k in _key(b)])
    assert sorted(rows.tolist()) == list(range(len(src))) and not torch.equal(rows, torch.arange(len(src)))
    assert all(torch.equal(b[k], v[rows]) for k, v in a.items())
    if fmt == "arrow":
        import datasets as hf

        assert hf.load_from_disk(str(out)).num_rows == len(src)
    with pytest.raises(ValueError, match="is not an empty folder"):
        write_shuffled(src, out)
