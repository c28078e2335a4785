"""Hub ids through huggingface_hub (a cache laid out as the library lays it out), and vLLM's loading options."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import random_prompts
from tapllm import LLM, SamplingParams

REPO = "tapllm-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _cache(tmp_path: Path, folder: Path) -> Path:
    """A Hugging Face hub cache holding ``REPO`` at ``main`` (COMMIT) and at tag ``v1`` (OTHER, 1 layer fewer)."""
    hub = tmp_path / "hf" / "hub"
    repo = hub / ("models--" + REPO.replace("/", "--"))
    for commit in (COMMIT, OTHER):
        shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(OTHER)
    return hub


def _tokens(llm: LLM) -> list[int]:
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    return llm.generate(random_prompts([7], seed=3), params, use_tqdm=False)[0].outputs[0].token_ids


def test_hub_id_resolves_from_the_local_cache(tiny_models, tmp_path):
    hub = _cache(tmp_path, tiny_models["llama"])
    want = _tokens(LLM(tiny_models["llama"], dtype="float32"))
    llm = LLM(REPO, dtype="float32", download_dir=hub)
    assert llm.engine.model_config.path == hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert _tokens(llm) == want
    tagged = LLM(REPO, revision="v1", dtype="float32", download_dir=hub)
    assert tagged.engine.model_config.path.name == OTHER
    assert LLM(REPO, revision=COMMIT, dtype="float32", download_dir=hub).engine.model_config.path.name == COMMIT


def test_missing_hub_id_offline_names_the_id_cache_and_flag(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub = tmp_path / "empty-hub"
    with pytest.raises(FileNotFoundError) as err:
        LLM("nobody/nothing", download_dir=hub)
    message = str(err.value)
    assert "'nobody/nothing'" in message and str(hub) in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ValueError, match="revision"):
        LLM(tmp_path, revision="main")  # a local path has no revisions


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapllm", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_cli_resolves_hub_ids_through_hf_home(tiny_models, tmp_path):
    hub = _cache(tmp_path, tiny_models["llama"])
    env = {"HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    r = _cli(["generate", "hello", "--model", REPO, "--max-tokens", "3", "--ignore-eos", "--dtype", "float32"], env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "found in the Hugging Face cache" in r.stderr and r.stdout.strip()
    r = _cli(["generate", "hello", "--model", "nobody/nothing"], env)
    assert r.returncode == 2 and "nobody/nothing" in r.stderr and "HF_HUB_OFFLINE" in r.stderr
    # Online but unreachable: the download is tried and its failure named.
    r = _cli(["generate", "hello", "--model", "nobody/nothing"],
             {"HF_HOME": str(tmp_path / "other"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
              "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"})
    assert r.returncode == 2 and "downloading it failed" in r.stderr


def test_vllm_loading_options(tiny_models, tmp_path, caplog):
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(tiny_models["llama"], trust_remote_code=True)
    LLM(tiny_models["llama"], trust_remote_code=False, dtype="float32")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_models["llama"], tensor_parallel_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(tiny_models["llama"], gpu_memory_utilization=1.5)
    with caplog.at_level("INFO", logger="tapllm"):
        LLM(tiny_models["llama"], gpu_memory_utilization=0.9, dtype="float32")
    assert "gpu_memory_utilization is ignored on CPU" in caplog.text
    short = LLM(tiny_models["llama"], max_model_len=64, dtype="float32")
    assert short.engine.model_config.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate([list(range(100, 170))], use_tqdm=False)
    with pytest.raises(ValueError, match="longer than the model's context"):
        LLM(tiny_models["llama"], max_model_len=4096)
    with pytest.raises(TypeError, match="unexpected keyword"):
        LLM(tiny_models["llama"], no_such_option=1)


def test_tokenizer_from_another_folder(tiny_models, tmp_path):
    weights = tmp_path / "weights-only"
    tok = tmp_path / "tokenizer"
    weights.mkdir()
    tok.mkdir()
    for f in tiny_models["llama"].iterdir():
        shutil.copy(f, (tok if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) else weights)
                    / f.name)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        LLM(weights, dtype="float32")
    llm = LLM(weights, tokenizer=str(tok), dtype="float32")
    assert _tokens(llm) == _tokens(LLM(tiny_models["llama"], dtype="float32"))


def test_pytorch_bin_checkpoints_load(tiny_models, tmp_path):
    """Older checkpoints (a training run's intermediate revisions) ship pytorch_model.bin only."""
    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "bin-only"
    shutil.copytree(tiny_models["llama"], folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    assert _tokens(LLM(folder, dtype="float32")) == _tokens(LLM(tiny_models["llama"], dtype="float32"))
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="corrupt checkpoint file .*pytorch_model.bin"):
        LLM(folder, dtype="float32")
