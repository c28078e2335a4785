"""``tapllm plan MODEL_OR_CONFIG --tensor-parallel-size N``: how a model splits over N ranks, nothing loaded.

Each rank's shard is built on PyTorch's meta device (:func:`tapllm.parallel.plan.plan_split`): the
bytes of its weights, module buffers and KV cache, and whether they fit a device's memory.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``plan`` subcommand."""
    p = sub.add_parser("plan", help="how a model splits over tensor-parallel ranks and pipeline stages: "
                                         "bytes per rank (nothing loaded)")
    p.add_argument("model", metavar="MODEL_OR_CONFIG", help="model folder, or a config .json file")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="ranks (default 1)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="stages of blocks, each split over --tensor-parallel-size ranks (default 1)")
    p.add_argument("--dtype", default="auto",
                   help="auto (the checkpoint's declared dtype) | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="sequences of --max-model-len tokens the KV cache holds (default 1)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="size the KV cache for this many tokens instead of --max-num-seqs x --max-model-len")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="each rank's device memory, to check the fit")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the share of --gpu-memory-gib weights and KV cache may fill (default 0.9)")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4", "q4_k"],
                   help="plan the weights quantized as the engine quantizes them (each rank's packed blocks)")
    p.add_argument("--quantization-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="with --quantization int4: inputs per group (default 128)")
    p.add_argument("--no-quantize-embedding", dest="quantize_embedding", action="store_false",
                   help="with --quantization, keep the embedding table in --dtype")
    p.add_argument("--quiet", action="store_true", help="only print the plan")


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit status 0 (also when it does not fit: the plan says so)."""
    from tapllm.parallel.plan import plan_split

    print(plan_split(args.model, args.tensor_parallel_size, args.dtype, max_model_len=args.max_model_len,
                     max_num_seqs=args.max_num_seqs, kv_tokens=args.kv_tokens, gpu_memory_gib=args.gpu_memory_gib,
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     pipeline_parallel_size=args.pipeline_parallel_size, quantization=args.quantization,
                     quantization_group_size=args.quantization_group_size,
                     quantize_embedding=args.quantize_embedding))
    return 0
