"""SAELens' activation cache for ``benchmarks/collect.py``: runs in SAELens' own virtual
environment (``python3 -m venv /tmp/saelens && /tmp/saelens/bin/pip install torch==2.13.0
sae-lens``) and prints one JSON line.

``CacheActivationsRunner`` on a local Hugging Face model folder (``model_class_name=
"AutoModelForCausalLM"``: SAELens' hooked wrapper of a transformers model), a local Parquet
dataset streamed with its ``text`` column, one hook, ``--context-size`` tokens per context
with BOS, ``--tokens`` tokens in all, stored in float32. Then shuffled passes over the
cached dataset (``datasets.load_from_disk(...).with_format("torch")`` in a ``DataLoader``,
each row a context), reported in token rows/s.

``--read-only`` reads an existing cache (the best of ``--repeats`` passes), so the caller can
interleave both sides' reads. With ``--tapllm-dataset DIR`` (and tapllm importable:
``PYTHONPATH`` at the repository) it runs only SAELens' own ``SAETrainer`` fed by
``tapllm.collect.saelens_source.SAELensSource`` over that dataset (context-level shuffle) for
``--train-steps`` steps of a ``TopKTrainingSAE`` (``d_sae = 4 * d_in``, k = 32): the steps
taken, the loss of the first and last steps.
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
    p.add_argument("--repeats", type=int, default=3, help="shuffled passes; the best is reported")
    p.add_argument("--read-only", action="store_true", help="only read the cache already at --out")
    p.add_argument("--tapllm-dataset", default=None, help="only train SAELens' SAETrainer from this tapllm dataset")
    p.add_argument("--tapllm-layer", type=int, default=None)
    p.add_argument("--train-steps", type=int, default=8)
    args = p.parse_args()

    if args.tapllm_dataset:
        print(json.dumps({"trainer": train_from_tapllm(args)}))
        return
    result = {} if args.read_only else cache(args)
    result.update(read(args))
    print(json.dumps(result))


def cache(args: argparse.Namespace) -> dict:
    """SAELens' CacheActivationsRunner, timed (the model load is not)."""
    import torch
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

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
    return {"rows": ds.num_rows * args.context_size, "seconds": time.perf_counter() - t0}


def read(args: argparse.Namespace) -> dict:
    """The best of ``--repeats`` shuffled passes over the cache, in token rows/s."""
    import datasets
    from torch.utils.data import DataLoader

    cached = datasets.load_from_disk(args.out).with_format("torch")
    per_batch = max(1, args.read_batch // args.context_size)
    best = 0.0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        rows = sum(int(b[args.hook].shape[0]) * args.context_size
                   for b in DataLoader(cached, batch_size=per_batch, shuffle=True))
        best = max(best, rows / (time.perf_counter() - t0))
    return {"read_rows": rows, "read_rate": best}


def train_from_tapllm(args: argparse.Namespace) -> dict:
    """SAELens' trainer with tapllm's dataset as its data provider, a few steps."""
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig

    from tapllm.collect.saelens_source import SAELensSource

    source = SAELensSource(args.tapllm_dataset, layer=args.tapllm_layer, batch_size=args.read_batch, unit="context")
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=args.d_in, d_sae=4 * args.d_in, k=32))
    cfg = SAETrainerConfig(total_training_samples=args.train_steps * args.read_batch,
                           train_batch_size_samples=args.read_batch, lr=3e-4, lr_end=3e-4,
                           n_batches_for_norm_estimate=2, logger=LoggingConfig(log_to_wandb=False))
    trainer = SAETrainer(cfg, sae, data_provider=source)
    losses = []
    step = trainer.step

    def recorded(batch):  # the trainer's own step; its loss kept for the report
        out = step(batch)
        losses.append(float(out.loss))
        return out

    trainer.step = recorded
    t0 = time.perf_counter()
    trainer.fit()
    return {"steps": trainer.n_training_steps, "samples": trainer.n_training_samples, "epochs": source.epoch,
            "first_loss": losses[0], "last_loss": losses[-1], "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    main()
