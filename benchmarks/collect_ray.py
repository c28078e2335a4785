"""``tapllm collect --dataset`` on a local 2-node Ray cluster against one process.

What it measures
    A ``save_to_disk`` dataset of ``--records`` random word texts, cut into contexts of
    ``--context-size`` (one document per context, no packing), every block's ``resid_post``,
    float32, collected twice: in this process with one intra-op thread, and with
    ``--ray-address`` on a ``ray.cluster_utils.Cluster`` of 2 nodes of 1 CPU each
    (``--workers 2``: each worker reads its own half of the dataset). It checks that the two
    datasets hold the same rows in the same order (token ids and positions equal, states
    within float32 rounding) and prints rows/s: the one-process run's, and each Ray worker's
    (its rows over the seconds of its collect loop, engine start excluded, from the driver's
    log), plus the Ray run's wall time including the actors' start.

    The model is a tiny random Llama (hidden 64, 3 blocks, the default model's tokenizer)
    unless ``--model`` names one. On a 2-core machine both nodes share the same cores with
    the driver: the figures show the data path, not a speed-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch


def _tiny_model(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from tapllm.loader import resolve_model

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(resolve_model(None))).save_pretrained(folder)
    return folder


def _rows(path: Path) -> dict[str, torch.Tensor]:
    import tapllm.datasets

    cols: dict[str, list[torch.Tensor]] = {}
    for batch in tapllm.datasets.open(path).iter_batches(65536):
        for k, v in batch.items():
            cols.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in cols.items()}


class _Rates(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("part "):
            self.lines.append(record.getMessage())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder or id (default: a tiny random Llama)")
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--context-size", type=int, default=128)
    args = p.parse_args()

    import datasets
    import ray
    from ray.cluster_utils import Cluster

    from tapllm.collect.hf_input import DatasetSpec
    from tapllm.collect.run import CollectConfig, collect
    from tapllm.config import EngineConfig

    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "seven", "quiet", "north"]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or str(_tiny_model(root / "model"))
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 150))) for _ in range(args.records)]
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "ds"))

        def cfg(out: str, workers: int) -> CollectConfig:
            return CollectConfig(out=root / out, dataset=DatasetSpec(str(root / "ds")), layers="all",
                                 points=["resid_post"], context_size=args.context_size, shard_tokens=8192,
                                 workers=workers, engine=EngineConfig(model=model, dtype="float32"))

        torch.set_num_threads(1)
        t0 = time.perf_counter()
        one = collect(cfg("one", 1), show_progress=False)
        print(f"one process, 1 thread: {one['num_rows']} rows in {one['seconds']:.1f} s "
              f"({one['num_rows'] / one['seconds']:.0f} rows/s; {time.perf_counter() - t0:.1f} s with the engine start)")

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        rates = _Rates()
        log = logging.getLogger("tapllm")
        log.addHandler(rates)
        log.setLevel(logging.INFO)
        try:
            t0 = time.perf_counter()
            meta = collect(cfg("ray", 2), ray_address=cluster.address, show_progress=False)
            wall = time.perf_counter() - t0
        finally:
            ray.shutdown()
            cluster.shutdown()
        a, b = _rows(root / "one"), _rows(root / "ray")
        same = all(torch.equal(a[k], b[k]) for k in ("token_id", "position"))
        diff = float((a["resid_post"] - b["resid_post"]).abs().max())
        print(f"Ray, 2 nodes x 1 CPU: {meta['num_rows']} rows, {wall:.1f} s wall with the actors' start")
        for line in rates.lines:
            print(f"  worker {line}")
        print(f"same rows in the same order: {same}; states max |diff| {diff:.2e}")
        print(f"load average: {os.getloadavg()}")
        if not same or diff > 1e-5 * float(a["resid_post"].abs().max()):
            sys.exit(1)


if __name__ == "__main__":
    main()
