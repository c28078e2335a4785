"""``python -m tapllm.kernels``: build and try tapllm's CPU kernels now, not at the first start.

Builds the variant torch dispatches to on this machine (the one every start loads: AVX512, AVX2
or generic; ``--variant`` adds others, e.g. for runs under ``ATEN_CPU_CAPABILITY=avx2``) into the
kernel cache, runs the trials against PyTorch (remembered beside the build, see
:mod:`tapllm.kernels.trials`) and the packed-GEMV probes, and prints one line per result.
``scripts/install.sh`` runs it; so does a ``pip install`` of tapllm where torch is already
installed (``setup.py``). Without a C++ compiler it says so and exits 0: tapllm then runs its
eager PyTorch step. Exit status 1 when a compiler exists but the build or a trial fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Build, try and report; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tapllm.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], choices=["avx512", "avx2", "default"],
                        help="also build this instruction-set variant (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    import torch

    from tapllm.kernels import fused_kernels, kernels_status, variant
    from tapllm.kernels.build import build, compiler

    if os.environ.get("TAPLLM_KERNELS", "1") == "0":
        print("tapllm kernels: not built (TAPLLM_KERNELS=0)")
        return 0
    if compiler() is None:
        print("tapllm kernels: no C++ compiler found (set CXX or install g++): tapllm runs its eager PyTorch step")
        return 0
    t0 = time.perf_counter()
    ops = fused_kernels()
    print(f"tapllm kernels: {kernels_status()}, ready in {time.perf_counter() - t0:.1f} s")
    if ops is None:
        return 1
    from tapllm.kernels.gemv import packed_gemv_status
    from tapllm.utils.platform import cpu_support

    for dtype in (torch.bfloat16, torch.float32):
        if dtype in cpu_support().packable:
            print(f"packed GEMV ({dtype}): {packed_gemv_status(ops, dtype)}")
    status = 0
    for extra in dict.fromkeys(args.variant):
        if extra == variant():
            continue
        # Another variant loads only where torch dispatches to it: build and try it in a process that does.
        t0 = time.perf_counter()
        try:
            build(extra)
        except RuntimeError as exc:
            print(f"tapllm kernels: {extra} build failed: {str(exc).strip().splitlines()[-1]}")
            status = 1
            continue
        env = {**os.environ, "ATEN_CPU_CAPABILITY": extra}
        proc = subprocess.run([sys.executable, "-c", "from tapllm.kernels import fused_kernels, kernels_status\n"
                               "ok = fused_kernels() is not None; print(kernels_status()); raise SystemExit(not ok)"],
                              capture_output=True, text=True, env=env)
        print(f"tapllm kernels: {proc.stdout.strip() or proc.stderr.strip()[-300:]}, "
              f"ready in {time.perf_counter() - t0:.1f} s")
        status |= proc.returncode != 0
    return status


if __name__ == "__main__":
    raise SystemExit(main())
