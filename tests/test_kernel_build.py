"""The fused kernels must be on wherever a C++ compiler is (outside test_kernels.py, whose tests
skip without kernels: a broken build must fail here, not skip there); the build compiles every
source of csrc/ and generates the constants C++ shares with Python."""

from __future__ import annotations

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
