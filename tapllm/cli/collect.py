"""``tapllm collect``: hidden states of a whole dataset, written to shards (see ``tapllm.collect``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tapllm.cli.args import add_engine_args
from tapllm.tap.points import POINTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``collect`` subcommand."""
    col = sub.add_parser("collect", help="hidden states of a dataset into sharded files (resumable, Ray)")
    src = col.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", type=Path, help="JSONL (text | messages | prompt_token_ids), "
                     "Parquet, or a datasets save_to_disk folder: one request per record")
    src.add_argument("--dataset", metavar="NAME_OR_PATH", help="any Hugging Face datasets dataset, streamed: a "
                     "save_to_disk folder, Parquet/JSONL/CSV/text files (or a glob), a folder of them, or a Hub "
                     "name in the local datasets cache; cut into contexts (see --context-size)")
    col.add_argument("--split", default="train", help="--dataset split (default: train)")
    col.add_argument("--column", default="text", help="--dataset column: text, or token ids (default: text)")
    col.add_argument("--context-size", type=int, default=None,
                     help="--dataset: tokens per context (default: the model's context)")
    col.add_argument("--packing", action="store_true", help="--dataset: concatenate the documents and cut "
                     "them into full contexts (SAELens' concatenate-and-chunk); default: each document by itself, "
                     "a long one chunked")
    col.add_argument("--truncate", action="store_true",
                     help="--dataset: keep only each document's first context (default: chunk it)")
    col.add_argument("--prepend-bos", action=argparse.BooleanOptionalAction, default=None,
                     help="--dataset: start every context (and document) with BOS (default: when the tokenizer "
                     "has one)")
    col.add_argument("--max-rows", type=int, default=None, help="--dataset: read at most this many records")
    col.add_argument("--max-tokens-total", type=int, default=None,
                     help="--dataset: run at most this many tokens in all")
    col.add_argument("--exclude-special-tokens", action="store_true",
                     help="leave out the rows of the tokenizer's special tokens (BOS, EOS, ...)")
    col.add_argument("--store-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                     help="dtype of the stored states (default: the compute dtype; float32 for bfloat16 in Arrow)")
    col.add_argument("--out", type=Path, required=True, help="output folder")
    col.add_argument("--layers", default="all", help="block indices, e.g. 0,12,-1, or 'all'")
    col.add_argument("--points", default="resid_post",
                     help=f"comma-separated points: {', '.join(POINTS)} ('none': only --sae features or --router columns)")
    col.add_argument("--sae", default=None, metavar="PATH",
                     help="also store this SAE's top latents per row, sparse (sae_ids, sae_values, sae_error_norm)")
    col.add_argument("--sae-top", type=int, default=64, help="latents kept per row with --sae (default 64)")
    col.add_argument("--router", action="store_true",
                     help="a mixture-of-experts model: also store each token's chosen experts and their weights per "
                     "block (expert_ids int16 and expert_weights float32, [layers, top_k])")
    col.add_argument("--positions", default="prompt", choices=["prompt", "all"])
    col.add_argument("--max-tokens", type=int, default=0,
                     help="0 = prompts only; > 0 generates (greedy) and also captures generated positions "
                     "with --positions all")
    col.add_argument("--format", dest="fmt", default="safetensors", choices=["safetensors", "arrow"])
    col.add_argument("--shard-tokens", type=int, default=65536,
                     help="rows per shard: a group of consecutive records, cut at the first record that reaches "
                     "it, run by itself (so a resumed run is bitwise identical)")
    col.add_argument("--overwrite", action="store_true", help="replace a different run's dataset in --out")
    col.add_argument("--ray-address", default=None,
                     help="run on Ray: 'local' (start one here), 'auto' (the cluster this node belongs to) or an address")
    col.add_argument("--workers", type=int, default=1, help="Ray actors, one engine each (with --ray-address)")
    add_engine_args(col)
    # batch_invariant unset: on, unless --tensor- or --pipeline-parallel-size > 1 (not combinable with it yet).
    # --no-batch-invariant: faster, not resumable bitwise.
    col.set_defaults(max_num_seqs=64, batch_invariant=None)
    from tapllm.collect import eagle3_cli

    eagle3_cli.add_arguments(col)


def run(args: argparse.Namespace) -> int:
    """Collect, then print what was written."""
    from tapllm.collect import eagle3_cli
    from tapllm.collect.run import CollectConfig, DatasetSpec, collect
    from tapllm.config import EngineConfig

    layers: list[int] | str = args.layers
    if args.layers != "all":
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            raise ValueError(f"--layers must be 'all' or comma-separated integers, got {args.layers!r}") from None
    dataset = DatasetSpec(args.dataset, args.split, args.column) if args.dataset is not None else None
    if args.batch_invariant is None:
        args.batch_invariant = args.tensor_parallel_size == 1 and args.pipeline_parallel_size == 1
    recipe = eagle3_cli.settings(args)
    if recipe is not None:  # the recipe reads --max-rows and --max-tokens itself
        args.max_rows, args.max_tokens = None, 0
    if dataset is None and recipe is None and (args.split != "train" or args.column != "text"):
        raise ValueError("--split and --column apply to --dataset")
    cfg = CollectConfig(
        input=args.input, dataset=dataset, out=args.out, layers=layers,
        points=[] if args.points == "none" else args.points.split(","), sae=args.sae, sae_top=args.sae_top,
        router=args.router,
        positions=args.positions, max_tokens=args.max_tokens, fmt=args.fmt, shard_tokens=args.shard_tokens,
        workers=args.workers, overwrite=args.overwrite, context_size=args.context_size, packing=args.packing,
        truncate=args.truncate, prepend_bos=args.prepend_bos, max_rows=args.max_rows,
        max_tokens_total=args.max_tokens_total, exclude_special_tokens=args.exclude_special_tokens,
        store_dtype=args.store_dtype, engine=EngineConfig.from_cli_args(args), recipe=recipe,
    )
    meta = collect(cfg, ray_address=args.ray_address, show_progress=not args.quiet)
    secs = meta.get("seconds") or 0
    rate = f", {meta['num_rows'] / secs:.0f} tok/s" if secs else ""
    print(f"collected {meta['num_rows']:,} token rows from {meta['num_requests']:,} records into "
          f"{meta['num_shards']} {meta['storage']} shards ({meta['bytes'] / 1e6:.1f} MB) in {args.out}"
          f" [{secs:.1f} s{rate}]")
    return 0
