"""Every CPU: the probe, each fallback forced on (so every path runs on any machine), dtype auto.

An AVX2-only machine is also emulated for real in a subprocess: ``ONEDNN_MAX_CPU_ISA=AVX2``
makes oneDNN refuse bf16 packing exactly as such a CPU does, and ``ATEN_CPU_CAPABILITY=avx2``
makes torch's own kernels use AVX2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import random_prompts
import tapllm.utils.platform as platform
from tapllm import LLM, SamplingParams
from tapllm.layers.linear import Linear
from tapllm.utils.files import current_umask
from tapllm.utils.platform import CpuSupport, cpu_support

AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.fixture
def force(monkeypatch):
    """Make the probe report what a test says (packing only where this CPU really can)."""

    def _force(native_bf16: bool, packable: set[torch.dtype]) -> None:
        real = cpu_support()
        monkeypatch.setattr(platform, "_support", CpuSupport(
            "AVX2" if not native_bf16 else real.isa, native_bf16, frozenset(packable) & real.packable, "forced"))

    return _force


def _packed(llm: LLM) -> bool:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    return any(m.packed is not None for m in layers)


def _declaring(tiny_models, tmp_path, dtype: str):
    folder = tmp_path / f"declares-{dtype}"
    shutil.copytree(tiny_models["qwen3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_probe_is_consistent():
    s = cpu_support()
    assert s.isa == torch.backends.cpu.get_cpu_capability()
    assert torch.float32 in s.packable or s.reason  # fp32 packing works on every x86 oneDNN build
    if s.native_bf16:
        assert torch.bfloat16 in s.packable
    assert "native bf16" in s.describe()


@pytest.mark.parametrize("declared, native, expected", [
    ("bfloat16", False, torch.float32),
    ("bfloat16", True, torch.bfloat16),
    ("float16", False, torch.float32),
    ("float32", True, torch.float32),
    ("float32", False, torch.float32),
])
def test_dtype_auto_picks_the_fastest_correct_dtype(tiny_models, tmp_path, force, declared, native, expected):
    force(native_bf16=native, packable={torch.float32, torch.bfloat16})
    llm = LLM(_declaring(tiny_models, tmp_path, declared), dtype="auto")
    assert llm.engine.model_config.dtype == expected


def test_no_packing_gives_the_same_results(tiny_models, force):
    prompts = random_prompts([7, 19], seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0,
                            hidden_states={"layers": [1], "positions": "all"})
    default = LLM(tiny_models["llama"], dtype="float32").generate(prompts, params, use_tqdm=False)
    force(native_bf16=False, packable=set())
    plain = LLM(tiny_models["llama"], dtype="float32")
    assert not _packed(plain)
    for a, b in zip(plain.generate(prompts, params, use_tqdm=False), default):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = (a.hidden_states["resid_post"] - b.hidden_states["resid_post"]).abs().max()
        assert float(diff) <= 1e-5 * float(b.hidden_states["resid_post"].abs().max())


@pytest.mark.parametrize("packable", [set(), {torch.float32, torch.bfloat16}])
def test_bfloat16_runs_and_agrees_with_transformers_on_either_path(tiny_models, force, packable):
    """bf16 with and without oneDNN packing (an AVX2 CPU has only the plain path)."""
    from transformers import AutoModelForCausalLM

    force(native_bf16=torch.bfloat16 in packable, packable=packable)
    llm = LLM(tiny_models["qwen3"], dtype="bfloat16")
    assert _packed(llm) == (torch.bfloat16 in cpu_support().packable)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.bfloat16).eval()
    prompts = random_prompts([6, 11], seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = int(model(torch.tensor([p])).logits[0, -1].argmax())
        assert out.outputs[0].token_ids[0] == ref


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapllm", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_emulated_avx2_cpu_runs_bfloat16_without_packing(tiny_models):
    r = _run_cli(["generate", "hello there", "--model", str(tiny_models["llama"]), "--dtype", "bfloat16",
                  "--max-tokens", "3", "--ignore-eos"], AVX2_ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "plain F.linear" in r.stderr and "emulated on this CPU" in r.stderr
    assert r.stdout.strip()  # the completion


@pytest.mark.slow
def test_readme_main_command_on_an_emulated_avx2_cpu(tmp_path):
    """The README's first command (dtype auto) on an AVX2-only CPU: float32, prepacked, states saved."""
    out = tmp_path / "states.safetensors"
    r = _run_cli(["generate", "The three primary colors are", "--max-tokens", "8", "--hidden-states",
                  "layers=0,-1 points=resid_post positions=prompt reduce=mean", "--save", str(out)], AVX2_ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dtype auto -> float32" in r.stderr and "prepacked for oneDNN" in r.stderr
    assert out.is_file() and out.stat().st_mode & 0o777 == 0o666 & ~current_umask()
