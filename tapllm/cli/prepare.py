"""``tapllm prepare [MODEL]``: do now what a first start would do once, so that every start is fast.

Builds and tries the CPU kernels (:mod:`tapllm.kernels.prepare`), resolves the model (a GGUF file
is dequantized into tapllm's cache, a Hub id downloaded) and caches what transformers reads from
its config and tokenizer (:mod:`tapllm.utils.hf_config`, :mod:`tapllm.engine.cached_tokenizer`).
``scripts/install.sh`` runs it for the default model.
"""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``prepare`` subcommand."""
    p = sub.add_parser("prepare", help="build the kernels and cache a model's files now, so later starts are fast")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="model folder, .gguf file or Hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of a Hub model id")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id (default: the model's)")
    p.add_argument("--download-dir", default=None, help="Hugging Face cache folder (default: $HF_HUB_CACHE)")
    p.add_argument("--kernel-variant", action="append", default=[], choices=["avx512", "avx2", "default"],
                   help="also build this instruction-set variant of the kernels (repeatable)")
    p.add_argument("--no-kernels", action="store_true", help="leave the kernels to the first start")
    p.add_argument("--quiet", action="store_true", help="only the summary lines")


def run(args: argparse.Namespace) -> int:
    """Prepare the kernels and the model; the exit status (1 when a kernel build or trial failed)."""
    from tapllm.config import ModelConfig
    from tapllm.engine.tokenizer import load_tokenizer
    from tapllm.kernels.prepare import prepare_kernels
    from tapllm.loader import resolve_model, resolve_tokenizer

    ok = True if args.no_kernels else prepare_kernels(args.kernel_variant)
    t0 = time.perf_counter()
    folder = resolve_model(args.model_path, args.revision, args.download_dir)
    config = ModelConfig.from_folder(folder, "float32", "cpu")  # any dtype: only the files are cached
    tokenizer_folder = folder if args.tokenizer is None else resolve_tokenizer(args.tokenizer, None, args.download_dir)
    tokenizer = load_tokenizer(tokenizer_folder)
    print(f"model: {config.architecture} in {folder} ({type(tokenizer).__name__}), "
          f"ready in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1
