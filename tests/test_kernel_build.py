"""The fused kernels must be on wherever a C++ compiler is (outside test_kernels.py, whose tests
skip without kernels: a broken build must fail here, not skip there); the build compiles every
source of csrc/ and generates the constants C++ shares with Python."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tapllm.kernels import constants, fused_kernels, kernels_status
from tapllm.kernels.build import CSRC, HEADERS, SOURCES, cache_dir, compiler, constants_header


def test_kernels_are_on_wherever_a_compiler_is():
    if compiler() is None:
        assert fused_kernels() is None  # no compiler: the eager step, with the reason logged
        return
    assert fused_kernels() is not None, kernels_status()
    assert any(cache_dir().glob("*/libtapllm_*.so"))  # built once, into the cache


def test_every_source_and_header_is_built_and_keyed():
    assert set(SOURCES) == set(CSRC.glob("*.cpp"))  # a source left out would be neither compiled nor keyed
    assert set(HEADERS) == set(CSRC.glob("*.h"))  # a header left out would not rebuild the kernels when edited
    assert not (CSRC / "constants.h").exists()  # generated into each build, never kept beside the sources


def test_the_generated_header_holds_the_python_table():
    text = constants_header()
    assert f"constexpr int64_t GEMV_MAX_ROWS = {constants.GEMV_MAX_ROWS};" in text
    assert f"constexpr int64_t RMS_GEMMA = {constants.RMS_GEMMA};" in text
    for i, name in enumerate(constants.DECODER_SLOTS):
        assert f"constexpr int64_t {name} = {i};" in text
    assert f"constexpr int64_t DECODER_SLOTS_COUNT = {len(constants.DECODER_SLOTS)};" in text


def test_the_decoder_runner_counts_the_slots_of_the_python_table():
    ops = fused_kernels()
    if ops is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    x = torch.zeros(1, 8)
    params = [None] * (len(constants.DECODER_SLOTS) + 1)  # one slot too many for one layer
    with pytest.raises(RuntimeError, match=f"{len(constants.DECODER_SLOTS)} parameters per layer expected"):
        ops.decoder_layers(x, params, torch.ones(1, 8), torch.zeros(1, 8), torch.zeros(1, dtype=torch.long),
                           torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1, 1, 8, 1e-6, 1.0,
                           [0], constants.ACT_SILU, False)


def test_a_trial_that_passed_is_remembered_for_this_build_and_cpu(monkeypatch):
    import tapllm.kernels as kernels
    from tapllm.kernels.gemv import pack_rows, packed_gemv_ops
    from tapllm.kernels.trials import cpu_identity, recall

    ops = fused_kernels()
    if ops is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    folder = kernels.build_folder(ops)
    assert folder is not None and recall(folder, "kernels") is True
    assert (folder / f"trials-{cpu_identity()}.json").is_file()
    # A later start loads the same build without running the trials again ...
    monkeypatch.setattr(kernels, "_state", {})
    ran = []
    monkeypatch.setattr(kernels, "_trial", lambda o: ran.append(o))
    assert kernels.fused_kernels() is ops and ran == []
    # ... unless asked to, or on another CPU (or with another kernel environment)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("TAPLLM_KERNEL_TRIALS", "always")
    assert kernels.fused_kernels() is ops and ran == [ops]
    monkeypatch.delenv("TAPLLM_KERNEL_TRIALS")
    before = cpu_identity()
    monkeypatch.setenv("TAPLLM_NO_AVX512BF16", "1")
    assert cpu_identity() != before and recall(folder, "kernels") is None
    monkeypatch.delenv("TAPLLM_NO_AVX512BF16")
    if packed_gemv_ops(ops, torch.bfloat16) is not None:  # packed for 16 rows, or for one (an AMX CPU)
        assert recall(folder, "packed_gemv_bf16" if pack_rows(ops, torch.bfloat16) == 16 else
                      "packed_gemv_bf16_rows1") is True


def test_the_trials_file_survives_damage(tmp_path):
    from tapllm.kernels.trials import cpu_identity, recall, remember

    assert recall(tmp_path, "kernels") is None
    remember(tmp_path, "kernels", True)
    remember(tmp_path, "packed_gemv_bf16", True)
    assert recall(tmp_path, "kernels") is True and recall(tmp_path, "packed_gemv_bf16") is True
    (tmp_path / f"trials-{cpu_identity()}.json").write_text("{not json")
    assert recall(tmp_path, "kernels") is None  # a torn file: the trial runs again
    remember(tmp_path, "kernels", True)
    assert recall(tmp_path, "kernels") is True


def test_a_cached_build_is_found_without_torchs_extension_helpers():
    """A start that finds its build in the cache does not import torch.utils.cpp_extension (and setuptools)."""
    if compiler() is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    fused_kernels()  # built and indexed by now
    code = ("import sys\nfrom tapllm.kernels import fused_kernels\nassert fused_kernels() is not None\n"
            "print('torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "False"]


def test_python_m_tapllm_kernels_builds_tries_and_reports():
    proc = subprocess.run([sys.executable, "-m", "tapllm.kernels"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if compiler() is None:
        assert "no C++ compiler" in proc.stdout
        return
    assert f"tapllm kernels: {kernels_status()}, ready in" in proc.stdout, proc.stdout
