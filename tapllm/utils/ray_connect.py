"""Connecting to Ray, for everything of tapllm that runs actors (collection's workers, the ranks
of ``distributed_executor_backend="ray"``). Ray is imported only when this is called."""

from __future__ import annotations

import os
from typing import Any


def connect(address: str, workers: int) -> Any:
    """Ray, initialised unless it already is (then used as it is): ``address="local"`` starts a Ray
    instance on this machine (with at least ``workers`` CPUs), any other address joins that cluster."""
    import ray

    if not ray.is_initialized():
        if address == "local":
            # address="local" starts a new instance even where RAY_ADDRESS or /tmp/ray names a running one.
            ray.init(address="local", num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    return ray
