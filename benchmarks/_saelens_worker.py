"""SAELens' activation cache for ``benchmarks/collect.py``: runs in SAELens' own virtual
environment (``python3 -m venv /tmp/saelens && /tmp/saelens/bin/pip install torch==2.13.0
sae-lens``) and prints one JSON line.

``CacheActivationsRunner`` on a local Hugging Face model folder (``model_class_name=
"AutoModelForCausalLM"``: SAELens' hooked wrapper of a transformers model), a local Parquet
dataset streamed with its ``text`` column, one hook, ``--context-size`` tokens per context
with BOS, ``--tokens`` tokens in all, stored in float32. Then one shuffled pass over the
cached dataset (``datasets.load_from_disk(...).with_format("torch")`` in a ``DataLoader``,
each row a context), reported in token rows/s.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    """Cache, then read shuffled; print the timings."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hook", required=True)
    p.add_argument("--d-in", type=int, required=True)
    p.add_argument("--context-size", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--read-batch", type=int, default=4096)
    args = p.parse_args()

    import datasets
    import torch
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig
    from torch.utils.data import DataLoader

    cfg = CacheActivationsRunnerConfig(
        dataset_path=args.dataset, model_name=args.model, model_class_name="AutoModelForCausalLM",
        model_batch_size=args.batch, hook_name=args.hook, d_in=args.d_in, training_tokens=args.tokens,
        context_size=args.context_size, new_cached_activations_path=args.out, shuffle=False, dtype="float32",
        device="cpu", prepend_bos=True, streaming=True,
        # its buffer is filled whole whatever the token count: size it to the tokens asked for
        buffer_size_gb=(args.tokens * args.d_in * 4 + 1) / 1e9,
        model_from_pretrained_kwargs={"dtype": getattr(torch, args.dtype)},
    )
    runner = CacheActivationsRunner(cfg)  # loads the model (not timed, as on tapllm's side)
    t0 = time.perf_counter()
    ds = runner.run()
    seconds = time.perf_counter() - t0
    rows = ds.num_rows * args.context_size
    cached = datasets.load_from_disk(args.out).with_format("torch")
    per_batch = max(1, args.read_batch // args.context_size)
    t0 = time.perf_counter()
    read = sum(int(b[args.hook].shape[0]) * args.context_size
               for b in DataLoader(cached, batch_size=per_batch, shuffle=True))
    read_seconds = time.perf_counter() - t0
    print(json.dumps({"rows": rows, "seconds": seconds, "read_rows": read, "read_seconds": read_seconds}))


if __name__ == "__main__":
    main()
