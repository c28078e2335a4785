"""Build tapllm's C++ kernels with the machine's compiler, once, into an on-disk cache.

Why not ``torch.utils.cpp_extension.load``: it needs ninja and pybind11 and rebuilds into a
directory keyed by name only; the kernels here are plain ``torch.library`` ops (no Python
binding), so one ``g++`` call per instruction set is all a build is, and the cache key can
cover everything the binary depends on (source, torch build, compiler, flags).

The same source is compiled once per instruction set with ATen's ``at::vec`` selecting its
vector width (``CPU_CAPABILITY_AVX512``/``AVX2``), each variant into its own op namespace.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger("tapllm")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "decoder.cpp", CSRC / "prefill_attention.cpp", CSRC / "quant.cpp",
           CSRC / "quant_a8.cpp", CSRC / "quant_a8_gemm.cpp", CSRC / "packed_gemv.cpp")
HEADERS = (CSRC / "kernels.h", CSRC / "quant_layout.h", CSRC / "quant_a8.h")

# Compiler flags of each instruction-set variant (ATen's own names for its capability macros).
VARIANTS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}


def cache_dir() -> Path:
    """Where built kernels live: ``$TAPLLM_KERNEL_CACHE``, else ``kernels/`` in tapllm's cache
    (``$TAPLLM_CACHE`` or ``~/.cache/tapllm``, as for converted checkpoints)."""
    if os.environ.get("TAPLLM_KERNEL_CACHE"):
        return Path(os.environ["TAPLLM_KERNEL_CACHE"])
    root = os.environ.get("TAPLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tapllm")
    return Path(root) / "kernels"


def compiler() -> str | None:
    """The C++ compiler to use (``$CXX``, else ``g++``/``c++`` on PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _compile_flags(variant: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    flags = ["-O3", "-fPIC", "-std=c++20", "-fopenmp", "-fvisibility=hidden",
             "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
             f"-DTAPLLM_NS=tapllm_{variant}", *VARIANTS[variant]]
    return flags + [f"-I{p}" for p in include_paths()] + ["-I" + sysconfig.get_paths()["include"]]


def _link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths

    libs = library_paths()
    return [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch_cpu", "-ltorch"]


def _compile(cxx: str, variant: str, folder: Path, output: Path) -> None:
    """Compile every source to an object in parallel (one process each), then link ``output``."""
    objects = [folder / f"{src.stem}.o" for src in SOURCES]
    procs = [subprocess.Popen([cxx, *_compile_flags(variant), "-c", str(src), "-o", str(obj)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for src, obj in zip(SOURCES, objects)]
    errors = [proc.communicate()[1] for proc in procs]
    failed = [err for proc, err in zip(procs, errors) if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"compiling tapllm's kernels for {variant} failed:\n{failed[0][-4000:]}")
    proc = subprocess.run([cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(output), *_link_flags()],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"linking tapllm's kernels for {variant} failed:\n{proc.stderr[-4000:]}")


def build(variant: str) -> Path:
    """The path of the built library of ``variant``, compiling it first if the cache lacks it.

    Raises ``RuntimeError`` (with the compiler's message) when no compiler exists or it fails.
    """
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    flags = " ".join(_compile_flags(variant) + _link_flags())  # every flag and include path
    key_parts = [*(f.read_bytes() for f in SOURCES + HEADERS), torch.__version__.encode(),
                 str(torch.version.git_version).encode(), _compiler_version(cxx).encode(), flags.encode(),
                 sys.version.encode()]
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    folder = cache_dir() / f"{variant}-{key}"
    target = folder / f"libtapllm_{variant}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same variant
        if target.exists():
            return target
        t0 = time.perf_counter()
        logger.info("building tapllm's %s kernels (once; cached in %s)", variant, folder)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            out = Path(tmp) / target.name
            _compile(cxx, variant, Path(tmp), out)
            os.replace(out, target)  # atomic: a reader sees the whole library or none
        logger.info("built tapllm's %s kernels in %.1fs", variant, time.perf_counter() - t0)
    return target
