"""The flags several subcommands share: the engine's, sampling, prompts in and results out."""

from __future__ import annotations

import argparse
from pathlib import Path

from tapllm.tap.points import POINTS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (the fields of ``EngineConfig``), shared by every subcommand that loads a model."""
    p.add_argument("--model", default=None, help="model folder, .gguf file or Hugging Face Hub id "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of a Hub model id")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id (default: the model's)")
    p.add_argument("--download-dir", default=None, help="Hugging Face cache folder (default: $HF_HUB_CACHE)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None, help="a context shorter than the model's")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens of one step, decodes and prompt chunks together: smaller bounds the inter-token "
                        "latency of running streams while prompts arrive, larger gives throughput and time to "
                        "first token (default 2048)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="memory of the KV cache (default: a fifth of the available memory, at most 4 GB)")
    p.add_argument("--kv-cache-precommit", action="store_true",
                   help="commit the KV cache's memory at start-up, as vLLM does (no page faults inside steps)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on CUDA, the share of device memory to use (sizes the KV cache); ignored on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file (or the template text) used instead of the tokenizer's")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the plain PyTorch step instead of the fused C++ kernels (the reference path)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N processes on this CPU (tensor parallelism; default 1)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="split the model's blocks into N stages, one process (or --tensor-parallel-size "
                        "processes) each (pipeline parallelism; default 1)")
    p.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                   help="how the ranks beyond the first start with --tensor-parallel-size > 1: mp, processes on "
                        "this machine (default); ray, Ray actors in a placement group (the Ray initialised here, "
                        "else $RAY_ADDRESS's cluster, else a local Ray instance)")
    p.add_argument("--backend", default="auto", choices=["auto", "eager", "cpu", "cuda"],
                   help="the forward path (default auto: CUDA's on a GPU, the fused C++ kernels on a CPU)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="*", default=None, metavar="N",
                   help="batch sizes of decode steps captured as CUDA graphs at start-up (default 1, 2, 4, then "
                        "multiples of 8 up to --max-num-seqs; none given: no decode graphs)")
    p.add_argument("--cuda-graph-token-sizes", type=int, nargs="*", default=None, metavar="N",
                   help="token counts of steps with prefill chunks captured as CUDA graphs (default powers of two "
                        "from 16 up to --max-num-batched-tokens; none given: such steps run eagerly)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the host a step ahead of the device (default: on with CUDA graphs on a GPU)")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4", "q4_k", "gguf"],
                   help="keep weights quantized (weight-only): int8 (per channel), int4 (per group), "
                        "q4_k (int4 in GGUF's Q4_K super-blocks), gguf (a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors as stored)")
    p.add_argument("--quantization-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="int4 group size (default 128)")
    p.add_argument("--quantize-embedding", action=argparse.BooleanOptionalAction, default=True,
                   help="with --quantization, keep the embedding table quantized too (default; "
                        "--no-quantize-embedding keeps it in --dtype)")
    p.add_argument("--quantize-activations", action="store_true",
                   help="with --quantization, also round the quantized linears' inputs to int8 per 32 values "
                        "(llama.cpp's scheme: faster decoding, the rounding shows in every state; "
                        "results name it '+a8')")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                   help="every request's tokens, logprobs and states bitwise the same whatever else is in its "
                        "steps and however its prompt is chunked (CPU, or the CUDA backend; costs throughput, see "
                        "docs/generation.md)")
    p.add_argument("--quiet", action="store_true", help="only print results")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags of ``tapllm generate``."""
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


SPEC_HELP = (
    'what to capture, e.g. "layers=0,-1 points=resid_post positions=prompt reduce=mean"; keys: '
    f"layers (all | i,j,..), points ({','.join(POINTS)}), "
    "positions (prompt | generated | all | last_prompt | last | start:stop), reduce (mean | sum | max | "
    "min | first | last | plugin), dtype (float32 | float16 | bfloat16), heads (i,j,..: of q, z, attn_pattern), "
    "experts (i,j,..: of expert_out, required with it)"
)


def add_io_args(p: argparse.ArgumentParser) -> None:
    """A prompt or ``--input FILE``, ``--output`` and ``--chat``: ``generate`` and ``encode``."""
    p.add_argument("prompt", nargs="?", help="prompt text (omit with --input)")
    p.add_argument("--input", type=Path, help="JSONL file: one object per line with 'prompt', "
                   "'text', 'messages' (chat) or 'prompt_token_ids'")
    p.add_argument("--output", type=Path, help="write JSONL results here instead of stdout")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
