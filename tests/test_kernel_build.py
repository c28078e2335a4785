"""The fused kernels must be on wherever a C++ compiler is (outside test_kernels.py, whose tests
skip without kernels: a broken build must fail here, not skip there)."""

from __future__ import annotations

from tapllm.kernels import fused_kernels, kernels_status
from tapllm.kernels.build import cache_dir, compiler


def test_kernels_are_on_wherever_a_compiler_is():
    if compiler() is None:
        assert fused_kernels() is None  # no compiler: the eager step, with the reason logged
        return
    assert fused_kernels() is not None, kernels_status()
    assert any(cache_dir().glob("*/libtapllm_*.so"))  # built once, into the cache
