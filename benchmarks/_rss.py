"""Peak-RSS readings shared by the benchmark and its vLLM worker (which runs in another venv)."""

from __future__ import annotations

import re
import resource


def ru_maxrss_mib() -> float:
    """``getrusage`` peak RSS of this process in MiB (the field is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mib() -> float:
    """The RSS high-water mark (VmHWM) in MiB, or ``ru_maxrss`` where /proc is missing.

    VmHWM rather than ``ru_maxrss`` because it can be reset per phase and because the
    ``ru_maxrss`` of a process started by fork and exec also counts its parent's RSS.
    """
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        if match:
            return int(match.group(1)) / 1024
    except OSError:
        pass
    return ru_maxrss_mib()
