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

How to run (from the repository root)
    python benchmarks/collect.py                 # 256 prompts of 64..512 tokens
    python benchmarks/collect.py --quick         # 32 prompts of 16..128 tokens
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tapllm.collect.run import CollectConfig, collect  # noqa: E402
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
    print(f"tapllm / transformers = {(t_rows / t_sec) / (h_rows / h_sec):.2f}x rows/s")


if __name__ == "__main__":
    main()
