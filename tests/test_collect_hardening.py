"""``tapllm collect`` hardening: the folder lock, refusals before the weights load, messages
that name the line or file, and file modes that follow the umask."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

import tapllm.datasets
from tapllm.cli import main
from tapllm.collect.lock import LOCK_NAME, OutputBusyError, OutputLock

RECORDS = [{"text": "alpha beta gamma"}, {"prompt_token_ids": [200, 300, 400, 500]},
           {"messages": [{"role": "user", "content": "river stone"}]}, {"text": "north light"}]


def _jsonl(path: Path, records: list[dict] = RECORDS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(model: Path, inp: Path, out: Path, *extra: str, dtype: str = "float32") -> int:
    return main(["collect", "--model", str(model), "--input", str(inp), "--out", str(out), "--dtype", dtype,
                 "--quiet", "--layers", "0,-1", *extra])


def test_lock_is_exclusive_and_names_the_holder(tmp_path):
    with OutputLock(tmp_path):
        assert (tmp_path / LOCK_NAME).read_text().startswith(f"{os.getpid()} on ")
        with pytest.raises(OutputBusyError, match=f"--out {tmp_path} is in use by another tapllm collect run "
                                                  f"\\(pid {os.getpid()} on "):
            OutputLock(tmp_path).acquire()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released: no stale holder named
    with OutputLock(tmp_path):
        pass


def test_refusals_come_before_the_model_loads(tiny_models, tmp_path, capsys, monkeypatch):
    model = tiny_models["llama"]
    inp = _jsonl(tmp_path / "in.jsonl")
    done = tmp_path / "done"
    assert _run(model, inp, done) == 0
    capsys.readouterr()

    from tapllm.engine.llm_engine import LLMEngine

    def no_weights(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(LLMEngine, "__init__", no_weights)

    def err(out: Path, *extra: str, inp: Path = inp, dtype: str = "float32") -> str:
        assert _run(model, inp, out, *extra, dtype=dtype) == 2
        return capsys.readouterr().err

    # a complete dataset: returned as it is
    before = (done / "metadata.json").read_bytes()
    assert _run(model, inp, done) == 0
    assert "records into 1 safetensors shards" in capsys.readouterr().out
    assert (done / "metadata.json").read_bytes() == before
    # another run's dataset
    assert "holds a different run's dataset (layers: [0, 2] -> [1])" in err(done, "--layers", "1")
    # files that are not a tapllm dataset: refused, and no lock file put among them
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert "holds files that are not a tapllm dataset (notes.txt)" in err(other)
    assert sorted(f.name for f in other.iterdir()) == ["notes.txt"]
    # Arrow cannot hold bfloat16 (a bfloat16 run stores float32 there unless told otherwise)
    assert "Arrow has no bfloat16" in err(tmp_path / "bf16", "--format", "arrow", "--store-dtype", "bfloat16",
                                          dtype="bfloat16")
    # a layer the model does not have
    assert "layer 7 is out of range for a 3-block model" in err(tmp_path / "o1", "--layers", "0,7")
    # a record without a usable field
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"body": "x"}])
    assert "bad.jsonl:2: needs a 'text'" in err(tmp_path / "o2", inp=bad)
    # another run holds the folder
    busy = tmp_path / "busy"
    busy.mkdir()
    with OutputLock(busy):
        assert f"--out {busy} is in use by another tapllm collect run (pid {os.getpid()}" in err(busy)


def test_invalid_utf8_names_the_file_and_line(tiny_models, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"text": "fine"}\n{"text": "caf\xc3\xa9"}\n{"text": "bad \xff byte"}\n')
    assert _run(tiny_models["llama"], inp, tmp_path / "out") == 2
    assert f"{inp}:3: not valid UTF-8 (byte 0xff at byte 15 of the line)" in capsys.readouterr().err
    # a byte-order mark at the start is not an error
    inp.write_bytes(b'\xef\xbb\xbf{"text": "fine"}\n')
    assert _run(tiny_models["llama"], inp, tmp_path / "out") == 0


def test_write_failure_names_the_path(tiny_models, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    import safetensors.torch

    def denied(tensors, filename, metadata=None):
        raise SafetensorError(f"Error while serializing: I/O error: Permission denied (os error 13) at path "
                              f"\"{Path(filename).parent}/.tmpXyZ123\"")

    monkeypatch.setattr(safetensors.torch, "save_file", denied)
    out = tmp_path / "out"
    assert _run(tiny_models["llama"], _jsonl(tmp_path / "in.jsonl"), out) == 2
    assert f"cannot write {out}/part000-00000.safetensors: Permission denied" in capsys.readouterr().err
    assert not [f for f in out.iterdir() if f.name.startswith(".")]


@pytest.mark.parametrize(("umask", "fmt"), [(0o022, "arrow"), (0o027, "safetensors")],
                         ids=["022-arrow", "027-safetensors"])
def test_files_follow_the_umask(tiny_models, tmp_path, umask, fmt):
    out = tmp_path / "out"
    old = os.umask(umask)
    try:
        assert _run(tiny_models["llama"], _jsonl(tmp_path / "in.jsonl"), out, "--format", fmt,
                    "--shard-tokens", "8") == 0
    finally:
        os.umask(old)
    names = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    expected = {"run.json", "metadata.json", "progress-part000.jsonl", LOCK_NAME}
    if fmt == "arrow":
        expected |= {"state.json", "dataset_info.json"}
    shards = [n for n in names if n.startswith("part000-")]
    assert len(shards) >= 2 and expected <= names.keys()
    assert set(names) == expected | set(shards)
    assert {n: m for n, m in names.items() if m != 0o666 & ~umask} == {}
    assert len(tapllm.datasets.open(out)) == tapllm.datasets.open(out).metadata["num_rows"]


def test_atomic_folder_is_whole_or_absent(tmp_path):
    from tapllm.utils.files import atomic_path

    old = os.umask(0o022)
    try:
        with pytest.raises(RuntimeError):
            with atomic_path(tmp_path / "conv", folder=True) as tmp:
                (tmp / "model.safetensors").write_bytes(b"half")
                raise RuntimeError("killed mid-conversion")
        assert list(tmp_path.iterdir()) == []  # nothing left, not even the temporary
        with atomic_path(tmp_path / "conv", folder=True) as tmp:
            (tmp / "config.json").write_text("{}")
            os.chmod(tmp / "config.json", 0o600)  # as a library's own temporary would be
    finally:
        os.umask(old)
    assert [f.name for f in tmp_path.iterdir()] == ["conv"]
    assert stat.S_IMODE((tmp_path / "conv" / "config.json").stat().st_mode) == 0o644
    with pytest.raises(OSError):  # a folder already there (a concurrent conversion won) is kept
        with atomic_path(tmp_path / "conv", folder=True) as tmp:
            (tmp / "other").write_text("x")
    assert [f.name for f in (tmp_path / "conv").iterdir()] == ["config.json"]
    assert [f.name for f in tmp_path.iterdir()] == ["conv"]
