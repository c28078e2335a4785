"""What the CPU supports (probed once), and process-level settings that make CPU inference fast."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import mmap
import os
import sys
from dataclasses import dataclass

import torch

from tapllm.utils.dtypes import dtype_name

logger = logging.getLogger("tapllm")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (looked up once: ``find_library`` runs ``ldconfig``), or None where there is none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1  # mallopt takes a C int
_tuned = False


def tune_cpu_allocator() -> bool:
    """Stop glibc from handing large buffers back to the kernel after every free.

    Each step allocates and frees multi-megabyte temporaries (gathered KV context, prefill
    activations). By default glibc serves those with fresh ``mmap`` pages and unmaps them on
    free, so every step pays a page fault per 4 KiB touched: decode attention over long
    contexts ran 2-4x slower from that alone. Keeping them on the heap (what vLLM gets by
    preloading tcmalloc) removes it. Set ``TAPLLM_MALLOC_TUNING=0`` to leave malloc alone.
    """
    global _tuned
    if _tuned or os.environ.get("TAPLLM_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return _tuned
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc (e.g. musl): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    _tuned = ok
    if ok:
        logger.debug("glibc malloc tuned: large buffers stay on the heap")
    return ok


_M_ARENA_MAX = -8
API_MMAP_THRESHOLD = 256 << 10
API_ARENAS = 2


def tune_api_allocator() -> bool:
    """Hand a large buffer back to the kernel as soon as it is freed, in a process that runs no
    engine (an API server in front of an engine-core process). True when it took effect.

    glibc serves a buffer over its mmap threshold with an ``mmap`` of its own, unmapped on free,
    but raises the threshold to the size of each such buffer freed (up to 32 MiB): after the first
    request's states, every later one's (the tensors received from the core, their base64 and
    JSON text, a few MiB each) comes from the heap and the threads' arenas, where what a burst
    leaves behind pins pages that ``malloc_trim`` cannot return. A fixed threshold keeps every
    such buffer in its own mapping; two arenas (instead of 8 per core) keep the worker threads'
    small allocations from spreading over many. Not for a process that steps an engine, whose
    temporaries :func:`tune_cpu_allocator` keeps on the heap for speed. ``TAPLLM_MALLOC_TUNING=0``
    leaves malloc alone.
    """
    if os.environ.get("TAPLLM_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux") or _tuned:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc
        return False
    return mallopt(_M_MMAP_THRESHOLD, API_MMAP_THRESHOLD) == 1 and mallopt(_M_ARENA_MAX, API_ARENAS) == 1


def trim_heap() -> bool:
    """Hand the heap's free memory back to the kernel once (glibc ``malloc_trim``): after loading,
    the load's temporaries (e.g. float rows quantized one tensor at a time) would otherwise stay
    resident under :func:`tune_cpu_allocator`'s settings. True when it ran."""
    trim = getattr(_libc(), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if trim is None:  # not glibc
        return False
    trim(0)
    return True


def available_memory_bytes() -> int | None:
    """Memory the kernel can hand out now without swapping: ``MemAvailable`` from /proc/meminfo,
    else the free physical pages; ``None`` when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def release_free_memory(collect: bool = False) -> bool:
    """Hand the free parts of the heap back to the kernel (glibc ``malloc_trim``); False elsewhere.

    :func:`tune_cpu_allocator` keeps large buffers on the heap for speed, so memory a rare
    large request (a multi-megabyte HTTP body) used stays with the process; calling this
    after such a request returns it without giving up the per-step gain.

    ``collect``: run a full garbage collection first. Objects in reference cycles (an exception
    and its traceback's frames, a finished task and its callbacks) are freed only by a collection,
    and an idle process allocates nothing that would start the oldest generation's: whatever such
    a cycle holds (a request's encoded states, its response) would stay until the next burst.
    """
    if collect:
        gc.collect()
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


# oneDNN (bf16 and fp16 matmuls on CPU) keeps a compiled primitive per matrix shape in two LRU
# caches of 1,024 entries each: its own and the one of ideep, torch's wrapper. Every distinct row
# count of a prefill chunk or a batch is a new shape, ~0.3-0.6 MB each, so a server's resident
# memory grew by ~100 MB per burst of mixed requests and never came back. 64 entries hold the
# shapes of ~10 row counts for every weight of a step (a step uses 5-6), and bound the caches.
_ONEDNN_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_CACHE_ENTRIES = 64


def bound_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES) -> dict[str, str]:
    """Cap oneDNN's and ideep's primitive caches at ``entries`` unless the environment already
    sets them (both read their variable on first use, so this works after ``import torch`` as
    long as no bf16/fp16 matmul ran yet). The values in force."""
    for name in _ONEDNN_CACHE_ENV:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in _ONEDNN_CACHE_ENV}


_MADV_DONTNEED = 4  # Linux's value (mmap.MADV_DONTNEED where Python defines it)


def release_pages(address: int, length: int) -> int:
    """Hand back the whole pages of ``[address, address + length)`` in private anonymous memory
    (``madvise(MADV_DONTNEED)``): they leave the resident set and read as zeros when next touched.

    Only for memory whose content may be lost (e.g. KV cache blocks nobody uses); the partial
    pages at either end are kept. Returns the bytes handed back (0 off Linux or on failure).
    """
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + length) // page * page
    if end <= start or not sys.platform.startswith("linux"):
        return 0
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None:
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    advice = getattr(mmap, "MADV_DONTNEED", _MADV_DONTNEED)
    return end - start if madvise(start, end - start, advice) == 0 else 0


@dataclass(frozen=True, slots=True)
class CpuSupport:
    """What this CPU (and this torch build) computes well; probed once per process.

    Attributes:
        isa: the instruction set torch's own kernels dispatch to ("AVX512", "AVX2", ...).
        native_bf16: bfloat16 matmuls run on bf16 hardware (AVX512-BF16 or AMX) in both
            torch and oneDNN. Without it bf16 is emulated and 2.5-4x slower than float32.
        packable: dtypes whose linear weights oneDNN can prepack here (a trial pack decides).
        reason: why packing or native bf16 is off, for the log.
    """

    isa: str
    native_bf16: bool
    packable: frozenset[torch.dtype]
    reason: str = ""

    def describe(self) -> str:
        """One line for the log."""
        packed = ", ".join(dtype_name(d) for d in sorted(self.packable, key=str)) or "none"
        text = f"CPU {self.isa}, native bf16: {'yes' if self.native_bf16 else 'no'}, prepacked linears: {packed}"
        return f"{text} ({self.reason})" if self.reason else text


_PACK_CANDIDATES = (torch.float32, torch.bfloat16, torch.float16)


def _try_pack(dtype: torch.dtype) -> str | None:
    """Pack and run a small linear in ``dtype``; None when it works and agrees with ``F.linear``."""
    ops = getattr(torch.ops, "mkldnn", None)
    if ops is None or not hasattr(ops, "_reorder_linear_weight") or not hasattr(ops, "_linear_pointwise"):
        return "this torch build has no oneDNN linear packing ops"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g).to(dtype)
    x = torch.randn(3, 64, generator=g).to(dtype)
    try:
        packed = ops._reorder_linear_weight(w, 3)
        y = ops._linear_pointwise(x, packed, None, "none", [None], "")
    except Exception as exc:  # oneDNN refuses dtypes the CPU lacks (e.g. bf16 on AVX2)
        return str(exc).splitlines()[0]
    ref = torch.nn.functional.linear(x.float(), w.float())
    if y.shape != ref.shape or not torch.allclose(y.float(), ref, rtol=5e-2, atol=5e-2):
        return f"oneDNN's packed {dtype} linear disagrees with F.linear"
    return None


def _probe() -> CpuSupport:
    isa = torch.backends.cpu.get_cpu_capability()
    try:
        caps = dict(torch.cpu.get_capabilities())
    except Exception:  # older torch or an unknown platform: assume nothing special
        caps = {}
    reasons = []
    packable = set()
    if os.environ.get("TAPLLM_PACKED_LINEAR", "1") == "0":
        reasons.append("TAPLLM_PACKED_LINEAR=0")
    elif not torch.backends.mkldnn.is_available():
        reasons.append("torch was built without oneDNN")
    else:
        for dtype in _PACK_CANDIDATES:
            why = _try_pack(dtype)
            if why is None:
                packable.add(dtype)
            elif dtype != torch.float16:  # fp16 packing is a bonus; its absence is the norm
                reasons.append(f"{dtype_name(dtype)}: {why}")
    hw_bf16 = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    onednn_bf16 = torch.bfloat16 in packable or _mkldnn_bf16_supported()
    native = hw_bf16 and isa.startswith(("AVX512", "AMX")) and onednn_bf16
    return CpuSupport(isa, native, frozenset(packable), "; ".join(reasons))


def _mkldnn_bf16_supported() -> bool:
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:  # a private op: treat any failure as "no"
        return False


_support: CpuSupport | None = None


def cpu_support() -> CpuSupport:
    """The probed :class:`CpuSupport` of this process (probed on first use, then cached)."""
    global _support
    if _support is None:
        _support = _probe()
        logger.info("%s", _support.describe())
    return _support


def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively, else float32."""
    return torch.bfloat16 if cpu_support().native_bf16 else torch.float32


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means CUDA when available, else CPU; ``ValueError`` names an unusable device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {device!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but CUDA is not available here (torch {torch.__version__}); "
                             "use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
    return dev
