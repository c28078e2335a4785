"""setuptools hook: a ``pip install`` of tapllm also builds its CPU kernels for this machine.

Everything else about the package is in pyproject.toml. pip builds tapllm in an isolated
environment, but the kernels belong to the interpreter tapllm is installed into (its torch, its
headers, the kernel cache of ``tapllm/kernels/build.py``), so the build runs in a child process
of that interpreter, outside the isolation, on this source tree: ``python -m tapllm.kernels``.
Where that interpreter has no torch yet (torch is being installed in the same pip run), or no
C++ compiler, or ``TAPLLM_INSTALL_KERNELS=0`` is set, nothing is built here and the first start
builds them, as before. The install never fails because of the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Variables pip sets to isolate the build; the kernel build must see the target environment.
_ISOLATION = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PIP_BUILD_TRACKER")


class BuildPyWithKernels(build_py):
    """``build_py``, then the kernels (see the module docstring)."""

    def run(self) -> None:
        super().run()
        if os.environ.get("TAPLLM_INSTALL_KERNELS", "1") == "0":
            return
        env = {k: v for k, v in os.environ.items() if k not in _ISOLATION}
        env["PYTHONPATH"] = str(ROOT)
        probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
        if probe.returncode != 0:
            print("tapllm: torch is not installed yet; the CPU kernels will be built at the first start "
                  "(or run: python -m tapllm.kernels)")
            return
        proc = subprocess.run([sys.executable, "-m", "tapllm.kernels"], env=env, capture_output=True, text=True)
        print(proc.stdout.strip() or "tapllm: the kernel build printed nothing")
        if proc.returncode != 0:
            print(f"tapllm: the CPU kernels were not built ({proc.stderr.strip()[-500:]}); "
                  "the first start tries again")


setup(cmdclass={"build_py": BuildPyWithKernels})
