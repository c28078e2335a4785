"""Activation-dataset collection: ``tapllm collect`` against a plain transformers loop.

What it measures
    Token rows written per second for the default model (bf16), ``resid_pre`` of 3 blocks,
    prompts only, single process, in one run:

      tapllm        ``tapllm.collect.run.collect`` (the engine of ``tapllm collect``): continuous
                    batching, chunked prefill, capture plan, background shard writer.
      transformers  batches of ``--hf-batch`` prompts in input order, right-padded with an
                    attention mask, ``model(..., output_hidden_states=True)``; the 3 blocks'
                    rows at real (non-pad) positions are cut out per prompt and written with
                    the same shard writer, in the same format and shard size.

    Prompts are random token ids with lengths drawn uniformly from ``--min-len..--max-len``
    (fixed seed), as a dataset has prompts of many lengths. Both sides write safetensors
    shards of ``--shard-tokens`` rows to a temporary folder; the time counts from the first
    prompt to the last shard on disk (model loading excluded for both). Both results are
    checked to hold the same number of rows. Each side first runs a warm-up on a few prompts.

    Then the shuffled read throughput of ``tapllm.datasets.open`` on tapllm's dataset (token
    rows/s, one pass in random order, batches of ``--read-batch``, best of three passes; the
    files are in the page cache, as they are right after a collection; ``_read_worker.py``):
    a standard ``DataLoader(ds, batch_size=B, shuffle=True)`` (rows read through
    ``__getitems__`` and collated), a ``BatchSampler`` sampler with ``batch_size=None`` (one
    gather per batch), the ``ds.iterable(batch_size=B)`` shuffle-buffer view, and
    ``tapllm.collect.readers.ShuffledBatches`` shuffling tokens, blocks of 1024 rows, contexts,
    and contexts through a buffer of 16 batches. With ``--baseline-rev REV`` the first three
    are also measured with that revision's ``tapllm/`` (extracted with ``git archive``), on
    the same files in the same run: the code before and after, side by side.

    With ``--saelens-python PATH`` (the python of a virtual environment with ``sae-lens``),
    also SAELens' ``CacheActivationsRunner`` (``_saelens_worker.py``, on transformers through
    SAELens' hooked wrapper) against ``tapllm collect --dataset`` on the same work: a local
    Parquet dataset of texts, ``resid_post`` of the middle block (SAELens: the block's output
    hook), contexts of ``--context-size`` tokens packed with BOS, ``--sae-tokens`` tokens,
    stored in float32; and each side's shuffled read of its own dataset (SAELens: its cached
    dataset in a shuffled ``DataLoader``, one context a row, ``B / context`` contexts a batch),
    in ``--read-rounds`` rounds of both sides in turn, the best pass of each kept (the machine's
    load moves between the two), the targets printed as ratios: tapllm's context-level read against SAELens' read, and the
    token-level ``ShuffledBatches`` against the baseline revision's ``DataLoader(shuffle=True)``.
    Last, SAELens' own ``SAETrainer`` takes ``SAELensSource`` over tapllm's dataset as its
    data provider for ``--train-steps`` steps.

How to run (from the repository root)
    python benchmarks/collect.py                 # 256 prompts of 64..512 tokens
    python benchmarks/collect.py --quick         # 32 prompts of 16..128 tokens
    python benchmarks/collect.py --saelens-python /tmp/saelens/bin/python --baseline-rev 832280a
    python benchmarks/collect.py --only-saelens --saelens-python /tmp/saelens/bin/python --baseline-rev 832280a
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tapllm.collect.run import CollectConfig, DatasetSpec, collect  # noqa: E402
from tapllm.collect.writer import Manifest, ShardWriter  # noqa: E402
from tapllm.config import EngineConfig  # noqa: E402
from tapllm.loader import resolve_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--shard-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--read-batch", type=int, default=4096, help="rows per batch of the shuffled reads")
    p.add_argument("--saelens-python", default=None, help="python of a venv with sae-lens: run it as a peer")
    p.add_argument("--context-size", type=int, default=128)
    p.add_argument("--sae-tokens", type=int, default=65536, help="tokens of the SAELens comparison")
    p.add_argument("--only-saelens", action="store_true", help="run only the SAELens comparison")
    p.add_argument("--baseline-rev", default=None, help="git revision whose tapllm/ reads too (the code before)")
    p.add_argument("--train-steps", type=int, default=8, help="SAELens SAETrainer steps fed by tapllm's dataset")
    p.add_argument("--read-rounds", type=int, default=2, help="rounds of both sides' reads (SAELens comparison)")
    p.add_argument("--quick", action="store_true", help="32 prompts of 16..128 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.min_len, args.max_len = 32, 16, 128
    return args


def hf_collect(model: torch.nn.Module, prompts: list[list[int]], layers: list[int], out: Path, args: argparse.Namespace
               ) -> int:
    """The transformers loop; returns rows written."""
    out.mkdir()
    writer = ShardWriter(Manifest(out, 0), 0, "safetensors")
    group: list[dict[str, torch.Tensor]] = []
    first = rows = group_rows = 0
    with torch.inference_mode():
        for b in range(0, len(prompts), args.hf_batch):
            batch = prompts[b : b + args.hf_batch]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, : len(p)] = torch.tensor(p)
                mask[i, : len(p)] = 1
            hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            states = torch.stack([hs[i] for i in layers], dim=2)  # [batch, width, 3, hidden]
            for i, p in enumerate(batch):
                n = len(p)
                group.append({"token_id": torch.tensor(p), "request_index": torch.full((n,), b + i),
                              "position": torch.arange(n), "resid_pre": states[i, :n].clone()})
                rows += n
                group_rows += n
                if group_rows >= args.shard_tokens:  # the same cut as tapllm's groups
                    writer.put(first, b + i + 1, group)
                    group, first, group_rows = [], b + i + 1, 0
    if group:
        writer.put(first, len(prompts), group)
    writer.close()
    return rows


MODES = {
    "dataloader": "DataLoader(ds, shuffle=True)     token, rows collated",
    "batchsampler": "BatchSampler, batch_size=None    token, a gather a batch",
    "iterable": "ds.iterable()                    blocks through a buffer",
    "token": "ShuffledBatches unit=token",
    "block": "ShuffledBatches unit=block (1024 rows)",
    "context": "ShuffledBatches unit=context",
    "context+buffer": "ShuffledBatches unit=context, buffer",
}
BEFORE = "dataloader,batchsampler,iterable"  # what older revisions have


def read_rates(folder: Path, batch: int, code: Path, modes: str = ",".join(MODES)) -> dict[str, float]:
    """Token rows/s of one shuffled pass over the dataset in ``folder`` for each of ``modes``,
    read by the tapllm in ``code`` (``_read_worker.py`` in a fresh process)."""
    cmd = [sys.executable, str(Path(__file__).with_name("_read_worker.py")), "--folder", str(folder),
           "--batch", str(batch), "--modes", modes]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(code)})
    if done.returncode != 0:
        raise RuntimeError(f"read worker failed: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_code(rev: str, tmp: Path) -> Path:
    """``tapllm/`` of revision ``rev``, extracted into ``tmp`` (a folder to put on ``PYTHONPATH``)."""
    dest = tmp / f"baseline-{rev}"
    if dest.exists():
        return dest
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev, "tapllm"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def print_reads(folder: Path, args: argparse.Namespace, baseline: Path | None, row_bytes: float) -> dict[str, float]:
    """Read rates of this code (and of the baseline revision's where given), printed; returns them,
    the baseline's keyed ``before:MODE``."""
    rates = read_rates(folder, args.read_batch, REPO_ROOT)
    if baseline is not None:
        rates.update({f"before:{k}": v for k, v in read_rates(folder, args.read_batch, baseline, BEFORE).items()})
    print_rates(rates, args, row_bytes)
    return rates


def print_rates(rates: dict[str, float], args: argparse.Namespace, row_bytes: float) -> None:
    """One line a read mode."""
    for key, rate in rates.items():
        mode = key.removeprefix("before:")
        who = f"{args.baseline_rev}:" if key.startswith("before:") else "now:"
        print(f"  shuffled read {who:9s} {MODES[mode]:42s} {rate:9.0f} rows/s ({rate * row_bytes / 1e6:5.0f} MB/s)",
              flush=True)


WORDS = ("the of and to in is was for on that with as by it from at his an were are which this be or had not "
         "but first one their its new after who they have her she two been other when there all during into "
         "school time may years more most only over city some world would where later up such used many can "
         "state about national out known university united then made").split()


def saelens_peer(args: argparse.Namespace, folder: Path, num_layers: int, hidden: int, tmp_path: Path) -> None:
    """tapllm collect --dataset against SAELens' CacheActivationsRunner on the same work."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400))) for _ in range(args.sae_tokens // 100)]
    (tmp_path / "texts").mkdir()
    pq.write_table(pa.table({"text": texts}), tmp_path / "texts" / "data.parquet")
    layer = num_layers // 2
    print(f"contexts: {args.sae_tokens} tokens of a Parquet text dataset, contexts of {args.context_size} packed "
          f"with BOS, resid_post of block {layer}, stored float32, {args.dtype} compute", flush=True)

    def run(out: Path, tokens: int) -> dict:
        return collect(CollectConfig(out=out, dataset=DatasetSpec(str(tmp_path / "texts")),
                                     context_size=args.context_size, packing=True, prepend_bos=True,
                                     layers=[layer], points=["resid_post"], max_tokens_total=tokens,
                                     store_dtype="float32", shard_tokens=args.shard_tokens,
                                     engine=EngineConfig(dtype=args.dtype, max_num_seqs=64)), show_progress=False)

    run(tmp_path / "ctx-warm", 4 * args.context_size)
    meta = run(tmp_path / "ctx", args.sae_tokens)
    t_rate = meta["num_rows"] / meta["seconds"]
    print(f"  tapllm        {meta['num_rows']} rows in {meta['seconds']:7.2f} s = {t_rate:8.0f} rows/s", flush=True)
    cmd = [args.saelens_python, str(Path(__file__).with_name("_saelens_worker.py")), "--model", str(folder),
           "--dataset", str(tmp_path / "texts"), "--out", str(tmp_path / "saelens"),
           "--hook", f"model.layers.{layer}", "--d-in", str(hidden), "--context-size", str(args.context_size),
           "--tokens", str(args.sae_tokens), "--dtype", args.dtype, "--read-batch", str(args.read_batch)]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "PYTHONPATH": str(REPO_ROOT)}

    def saelens(*extra: str) -> dict | None:
        done = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"  SAELens failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-3:]}", flush=True)
            return None
        return json.loads(done.stdout.strip().splitlines()[-1])

    r = saelens("--repeats", "1")
    if r is None:
        return
    s_rate = r["rows"] / r["seconds"]
    print(f"  SAELens       {r['rows']} rows in {r['seconds']:7.2f} s = {s_rate:8.0f} rows/s", flush=True)
    print(f"tapllm / SAELens = {t_rate / s_rate:.2f}x rows/s collected", flush=True)
    # the reads in rounds, each side in turn, the best of each kept: the machine's load moves
    row_bytes = meta["bytes"] / max(meta["num_rows"], 1)
    baseline = baseline_code(args.baseline_rev, tmp_path) if args.baseline_rev else None
    rates: dict[str, float] = {}
    s_read = 0.0
    for _ in range(args.read_rounds):
        ours = read_rates(tmp_path / "ctx", args.read_batch, REPO_ROOT)
        if baseline is not None:
            ours.update({f"before:{k}": v for k, v in read_rates(tmp_path / "ctx", args.read_batch, baseline,
                                                                 BEFORE).items()})
        rates = {k: max(v, rates.get(k, 0.0)) for k, v in ours.items()}
        theirs = saelens("--read-only")
        if theirs is None:
            return
        s_read = max(s_read, theirs["read_rate"])
    print_rates(rates, args, row_bytes)
    print(f"  shuffled read SAELens:  {'load_from_disk + DataLoader(shuffle=True)':42s} {s_read:9.0f} rows/s "
          f"({s_read * row_bytes / 1e6:5.0f} MB/s)", flush=True)
    print(f"context-level read / SAELens' read = {rates['context'] / s_read:.2f}x (target >= 1.0); "
          f"with the buffer {rates['context+buffer'] / s_read:.2f}x", flush=True)
    if baseline is not None:
        before = rates["before:dataloader"]
        print(f"token-level ShuffledBatches / {args.baseline_rev}'s DataLoader(shuffle=True) = "
              f"{rates['token'] / before:.2f}x (target >= 3); DataLoader(shuffle=True) now / then = "
              f"{rates['dataloader'] / before:.2f}x", flush=True)
    t = saelens("--tapllm-dataset", str(tmp_path / "ctx"), "--train-steps", str(args.train_steps))
    if t is not None:
        t = t["trainer"]
        print(f"SAELens SAETrainer fed by tapllm's SAELensSource: {t['steps']} steps, {t['samples']} rows, "
              f"{t['epochs']} epoch(s), loss {t['first_loss']:.4g} -> {t['last_loss']:.4g}, {t['seconds']:.1f} s",
              flush=True)


def main(argv: list[str] | None = None) -> None:
    """Run both collectors and print the ratio."""
    args = parse_args(argv)
    folder = resolve_model(None)
    num_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    layers = [1, num_layers // 2, num_layers - 1]
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 49152) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.prompts)]
    total = sum(len(p) for p in prompts)
    print(f"collect: default model {args.dtype}, {args.prompts} prompts of {args.min_len}..{args.max_len} tokens "
          f"({total} rows), resid_pre of blocks {layers}, shards of {args.shard_tokens} rows", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.only_saelens:
            hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
            saelens_peer(args, folder, num_layers, hidden, tmp_path)
            return
        inp = tmp_path / "in.jsonl"
        inp.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
        warm = tmp_path / "warm.jsonl"
        warm.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts[: args.hf_batch]))
        common = dict(layers=layers, points=["resid_pre"], shard_tokens=args.shard_tokens,
                      engine=EngineConfig(dtype=args.dtype, max_num_seqs=64))
        collect(CollectConfig(input=warm, out=tmp_path / "tapllm-warm", **common), show_progress=False)
        meta = collect(CollectConfig(input=inp, out=tmp_path / "tapllm", **common), show_progress=False)
        t_rows, t_sec = meta["num_rows"], meta["seconds"]
        print(f"  tapllm        {t_rows} rows in {t_sec:7.2f} s = {t_rows / t_sec:8.0f} rows/s "
              f"({meta['num_shards']} shards, {meta['bytes'] / 1e6:.0f} MB)", flush=True)
        baseline = baseline_code(args.baseline_rev, tmp_path) if args.baseline_rev else None
        print_reads(tmp_path / "tapllm", args, baseline, meta["bytes"] / max(t_rows, 1))

        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, args.dtype)).eval()
        hf_collect(model, prompts[: args.hf_batch], layers, tmp_path / "hf-warm", args)  # warm-up
        t0 = time.perf_counter()
        h_rows = hf_collect(model, prompts, layers, tmp_path / "hf", args)
        h_sec = time.perf_counter() - t0
        print(f"  transformers  {h_rows} rows in {h_sec:7.2f} s = {h_rows / h_sec:8.0f} rows/s", flush=True)
        assert t_rows == h_rows == total, (t_rows, h_rows, total)
        print(f"tapllm / transformers = {(t_rows / t_sec) / (h_rows / h_sec):.2f}x rows/s", flush=True)
        if args.saelens_python:
            hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
            saelens_peer(args, folder, num_layers, hidden, tmp_path)


if __name__ == "__main__":
    main()
