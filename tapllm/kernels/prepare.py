"""Build and try tapllm's CPU kernels ahead of time (``python -m tapllm.kernels``, ``tapllm prepare``).

Builds the variant torch dispatches to on this machine (the one every start loads: AVX512, AVX2
or generic; ``variants`` adds others, e.g. for runs under ``ATEN_CPU_CAPABILITY=avx2``) into the
kernel cache, runs the trials against PyTorch (remembered beside the build, see
:mod:`tapllm.kernels.trials`) and the packed-GEMV probes, and reports one line per result.
Without a C++ compiler it says so and succeeds: tapllm then runs its eager PyTorch step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

VARIANTS = ("avx512", "avx2", "default")


def prepare_kernels(variants: Iterable[str] = (), report: Callable[[str], None] = print) -> bool:
    """Build and try the kernels; False when a compiler exists but a build or a trial failed."""
    import torch

    from tapllm.kernels import fused_kernels, kernels_status, variant
    from tapllm.kernels.build import build, compiler
    from tapllm.kernels.gemv import packed_gemv_status
    from tapllm.utils.dtypes import dtype_name
    from tapllm.utils.platform import cpu_support

    if os.environ.get("TAPLLM_KERNELS", "1") == "0":
        report("tapllm kernels: not built (TAPLLM_KERNELS=0)")
        return True
    if compiler() is None:
        report("tapllm kernels: no C++ compiler found (set CXX or install g++): tapllm runs its eager PyTorch step")
        return True
    t0 = time.perf_counter()
    ops = fused_kernels()
    report(f"tapllm kernels: {kernels_status()}, ready in {time.perf_counter() - t0:.1f} s")
    if ops is None:
        return False
    for dtype in (torch.bfloat16, torch.float32):
        if dtype in cpu_support().packable:
            report(f"packed {dtype_name(dtype)} GEMV: {packed_gemv_status(ops, dtype)}")
    ok = True
    for extra in dict.fromkeys(variants):
        if extra == variant():
            continue
        # A variant loads only where torch dispatches to it: build it here, try it in a process that does.
        t0 = time.perf_counter()
        try:
            build(extra)
        except RuntimeError as exc:
            report(f"tapllm kernels: {extra} build failed: {str(exc).strip().splitlines()[-1]}")
            ok = False
            continue
        code = ("from tapllm.kernels import fused_kernels, kernels_status\n"
                "ok = fused_kernels() is not None\nprint(kernels_status())\nraise SystemExit(not ok)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "ATEN_CPU_CAPABILITY": extra})
        report(f"tapllm kernels: {proc.stdout.strip() or proc.stderr.strip()[-300:]}, "
               f"ready in {time.perf_counter() - t0:.1f} s")
        ok = ok and proc.returncode == 0
    return ok
