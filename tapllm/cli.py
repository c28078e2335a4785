"""Command line: ``tapllm generate``, ``encode``, ``serve`` and ``collect``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from tapllm import lens_cli
from tapllm.sae import cli as features_cli
from tapllm._files import atomic_write
from tapllm.tap.points import POINTS


def _add_engine_args(p: argparse.ArgumentParser) -> None:
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
                        "latency of running streams while prompts arrive (256 kept serving p99 within 1.13x), "
                        "larger gives throughput and time to first token (default 2048)")
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
    p.add_argument("--quiet", action="store_true", help="only print results")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


_SPEC_HELP = (
    'what to capture, e.g. "layers=0,-1 points=resid_post positions=prompt reduce=mean"; keys: '
    f"layers (all | i,j,..), points ({','.join(POINTS)}), "
    "positions (prompt | generated | all | last_prompt | last | start:stop), reduce (mean | sum | max | "
    "min | first | last | plugin), dtype (float32 | float16 | bfloat16)"
)


def _add_io_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (omit with --input)")
    p.add_argument("--input", type=Path, help="JSONL file: one object per line with 'prompt', "
                   "'text', 'messages' (chat) or 'prompt_token_ids'")
    p.add_argument("--output", type=Path, help="write JSONL results here instead of stdout")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def build_parser() -> argparse.ArgumentParser:
    """The ``tapllm`` argument parser."""
    parser = argparse.ArgumentParser(prog="tapllm", description="tapllm: text and hidden states in one call")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, or a JSONL file of prompts")
    _add_io_args(gen)
    gen.add_argument("--hidden-states", metavar="SPEC", help=_SPEC_HELP)
    gen.add_argument("--save", type=Path, help="safetensors file for the states (a directory with --input)")
    gen.add_argument("--steer", type=Path, metavar="FILE", help="control vector to add: llama.cpp/repeng "
                     ".gguf or safetensors {layer: vector}")
    gen.add_argument("--steer-scale", type=float, default=1.0, help="scale of the --steer vector")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    enc = sub.add_parser("encode", help="hidden states of a prompt (or a JSONL file of prompts), no generation")
    _add_io_args(enc)
    enc.add_argument("--hidden-states", metavar="SPEC", default="", help=_SPEC_HELP + " (default: all blocks' "
                     "resid_post at every position)")
    enc.add_argument("--save", type=Path, help="safetensors file for the states (a directory with --input)")
    _add_engine_args(enc)
    lens_cli.add_parser(sub, _add_engine_args)
    features_cli.add_parser(sub, _add_engine_args)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on everything but /health (visible in ps: prefer "
                     "--api-key-file or $TAPLLM_API_KEY; none of them: open)")
    srv.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                     help="read the API key from the first line of this file")
    srv.add_argument("--served-model-name", default=None, help="the model id clients use (default: the folder name or GGUF file stem)")
    srv.add_argument("--enable-hidden-states", action="store_true",
                     help="serve the hidden_states extension (off by default for a shared service)")
    srv.add_argument("--hidden-states-max-bytes", dest="hidden_states_max_bytes_per_request", type=int,
                     default=64 << 20,
                     help="refuse requests whose states could exceed this many bytes (default 64 MiB)")
    srv.add_argument("--enable-steering", action="store_true",
                     help="serve the steering extension (off by default for a shared service)")
    srv.add_argument("--sae", action="append", default=[], metavar="NAME=PATH",
                     help="serve the SAE at PATH (folder, params.npz or hub id) as NAME, for the sae_features and "
                     "steering extensions (repeatable; clients can name only these)")
    srv.add_argument("--max-steers", dest="max_steers_per_request", type=int, default=16,
                     help="most steering entries per request")
    srv.add_argument("--max-logprobs", type=int, default=20,
                     help="most logprobs / top_logprobs a request may ask for (default 20, as vLLM)")
    srv.add_argument("--max-request-bytes", type=int, default=8 << 20,
                     help="largest request body accepted, in bytes (default 8 MiB; larger: 413)")
    srv.add_argument("--max-prompts-per-request", type=int, default=256,
                     help="most prompts in one completions or hidden_states request (default 256)")
    srv.add_argument("--max-connections", type=int, default=1000,
                     help="open connections (and requests) served at once; beyond: 503 (default 1000)")
    srv.add_argument("--keep-alive-timeout", type=float, default=5.0,
                     help="seconds an idle keep-alive connection stays open (default 5)")
    srv.add_argument("--header-read-timeout", type=float, default=10.0,
                     help="seconds a connection has to send a request's headers before it is closed (default 10)")
    srv.add_argument("--body-read-timeout", type=float, default=30.0,
                     help="seconds a client has to send a request's body (default 30; then 408)")
    srv.add_argument("--shutdown-timeout", type=float, default=10.0,
                     help="on SIGTERM/SIGINT, seconds requests in flight have to finish before they are aborted "
                     "(default 10; a second signal aborts them at once)")
    srv.add_argument("--api-server-count", type=int, default=1, metavar="N",
                     help="API server processes (HTTP, validation, tokenization, encoding of states) in front of "
                     "the engine core process, sharing the port (default 1)")
    srv.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                     help="engine core processes (replicas, each with its own KV cache and its share of the CPU "
                     "cores); requests go to the replica holding their prompt's prefix, else the least busy "
                     "(default 1)")
    srv.add_argument("--no-engine-process", action="store_true",
                     help="run the engine on a thread of the API server's process instead of in a process of its "
                     "own (as vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    _add_engine_args(srv)
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
                     help=f"comma-separated points: {', '.join(POINTS)} ('none': only --sae features)")
    col.add_argument("--sae", default=None, metavar="PATH",
                     help="also store this SAE's top latents per row, sparse (sae_ids, sae_values, sae_error_norm)")
    col.add_argument("--sae-top", type=int, default=64, help="latents kept per row with --sae (default 64)")
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
    _add_engine_args(col)
    col.set_defaults(max_num_seqs=64)
    from tapllm.collect import eagle3_cli

    eagle3_cli.add_arguments(col)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tapllm`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "collect":
            return _collect(args)
        if args.command == "lens":
            return lens_cli.run(args)
        if args.command == "features":
            return features_cli.run(args)
        return _run(args)
    except (ValueError, OSError, RuntimeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
    from tapllm.config import EngineConfig
    from tapllm.hidden_states.summary import summarize
    from tapllm.prompt_records import Item, read_jsonl, to_prompt

    encode = args.command == "encode"
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a prompt or --input FILE")
    spec = HiddenStatesSpec.parse(args.hidden_states) if args.hidden_states is not None else None
    steer_file = getattr(args, "steer", None)
    steering = [Steer.from_file(steer_file, scale=args.steer_scale)] if steer_file else None
    if args.save is not None and spec is None:
        raise ValueError("--save needs --hidden-states")
    if args.input is not None and spec is not None and args.save is None:
        raise ValueError("--hidden-states with --input needs --save DIR (one safetensors file per prompt)")
    if args.save is not None:
        _check_save_target(args.save, many=args.input is not None)
    items = [Item("text", args.prompt)] if args.input is None else read_jsonl(args.input)
    llm = LLM(config=EngineConfig.from_cli_args(args))
    prompts = [to_prompt(it, llm.apply_chat_template, args.chat) for it in items]
    bar = args.input is not None and not args.quiet
    if encode:
        outs = llm.encode(prompts, spec, use_tqdm=bar)
    else:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed if args.temperature else None,
            hidden_states=spec, steering=steering,
        )
        outs = llm.generate(prompts, params, use_tqdm=bar)
    if args.input is None:
        out = outs[0]
        if not encode:
            print(out.outputs[0].text)
        if out.hidden_states is not None:
            print(summarize(out.hidden_states))
            if args.save is not None:
                out.hidden_states.save(args.save, metadata={"prompt_token_ids": json.dumps(out.prompt_token_ids)})
                print(f"saved hidden states to {args.save}", file=sys.stderr)
        return 0
    rows = []
    for i, o in enumerate(outs):
        row: dict[str, Any] = {"index": i, "prompt": o.prompt}
        if not encode:
            c = o.outputs[0]
            row.update(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
        if o.hidden_states is not None:
            name = f"{i:06d}.safetensors"
            o.hidden_states.save(args.save / name, metadata={"prompt_token_ids": json.dumps(o.prompt_token_ids)})
            row["hidden_states_file"] = name
        rows.append(row)
    _write_jsonl(rows, args.output)
    return 0


def _register_saes(entries: list[str]) -> None:
    """``--sae NAME=PATH`` entries, loaded and registered before the server starts."""
    from tapllm.sae.features import register_sae

    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--sae: expected NAME=PATH, got {entry!r}")
        logging.getLogger("tapllm").info("serving SAE %s: %r", name, register_sae(name, path))


def _serve(args: argparse.Namespace) -> int:
    from tapllm.config import EngineConfig
    from tapllm.engine.llm_engine import LLMEngine

    if args.model is not None and args.model_path is not None:
        raise ValueError("give the model either as MODEL or as --model, not both")
    for flag in ("max_request_bytes", "max_prompts_per_request", "max_connections"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("keep_alive_timeout", "header_read_timeout", "body_read_timeout", "shutdown_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    api_key = _api_key(args)
    _register_saes(args.sae)
    model = args.model_path or args.model
    config = EngineConfig.from_cli_args(args, model=model)
    name = args.served_model_name or _model_name(model)
    for flag in ("api_server_count", "data_parallel_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.no_engine_process:
        if args.api_server_count != 1 or args.data_parallel_size != 1:
            raise ValueError("--api-server-count and --data-parallel-size need the engine core process: "
                             "drop --no-engine-process")
        return _serve_app(args, LLMEngine.from_config(config), name, api_key)
    from tapllm.server.api_servers import bind, serve_many
    from tapllm.server.core_client import CoreProcess, connect

    config.validate()
    # A SIGTERM while the cores load (before uvicorn handles signals) stops the cores too.
    signal.signal(signal.SIGTERM, _stop_before_serving)
    sock = bind(args.host, args.port) if args.api_server_count > 1 else None
    n = args.data_parallel_size
    cpus = _cpu_shares(n, args.api_server_count)
    cores: list[CoreProcess] = []
    try:
        cores.extend(CoreProcess(config, list(args.sae), args.quiet, cpus[i], i) for i in range(n))
        if sock is not None:
            return serve_many(args.api_server_count, cores, sock, _api_server, (args, config, name, api_key))
        client = connect([c.address for c in cores], [c.pid for c in cores], config)
        logging.getLogger("tapllm").info("engine core(s) running in process(es) %s", [c.pid for c in cores])
        return _serve_app(args, client, name, api_key)
    finally:
        for core in cores:
            core.stop()


def _stop_before_serving(sig: int, frame: Any) -> None:
    raise SystemExit(0)


def _cpu_shares(n: int, api_servers: int) -> list[list[int] | None]:
    """The CPUs each of ``n`` engine cores is pinned to (None: not pinned).

    As vLLM advises on CPUs, the API server processes keep CPUs of their own (one each, when
    that leaves the cores at least one each): an engine core's threads that share a CPU with
    the API server's busy event loop wait for each other at every parallel region. The rest
    is split into contiguous shares. With fewer CPUs than cores, nothing is pinned.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) - api_servers >= n:
        cpus = cpus[api_servers:]
    if len(cpus) < n or not cpus:
        return [None] * n
    per = len(cpus) // n
    return [cpus[i * per : (i + 1) * per] for i in range(n)]


def _api_server(sock: Any, addresses: list[str], pids: list[int], args: argparse.Namespace, config: Any, name: str,
                api_key: str | None) -> int:
    """One of ``--api-server-count`` API server processes (spawned: set up logging and SAEs again)."""
    from tapllm.server.core_client import connect

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format=f"%(asctime)s %(levelname)s [api {os.getpid()}] %(message)s")
    _register_saes(args.sae)
    return _serve_app(args, connect(addresses, pids, config), name, api_key, sock=sock)


def _serve_app(args: argparse.Namespace, engine: Any, name: str, api_key: str | None, sock: Any = None) -> int:
    """Serve ``engine`` (an ``LLMEngine``, or a ``CoreClient`` of an engine-core process) until a signal."""
    from tapllm.server import create_app
    from tapllm.server.serving import Lifecycle, run

    lifecycle = Lifecycle()
    app = create_app(engine, name, api_key=api_key, max_request_bytes=args.max_request_bytes,
                     max_prompts_per_request=args.max_prompts_per_request, body_read_timeout=args.body_read_timeout,
                     lifecycle=lifecycle)
    from tapllm.engine.llm_engine import LLMEngine

    cfg = engine.config if isinstance(engine, LLMEngine) else engine.engine.config
    logging.getLogger("tapllm").info(
        "serving %s on http://%s:%d (hidden states %s, steering %s, API key %s)", name, args.host, args.port,
        "on" if cfg.enable_hidden_states else "off", "on" if cfg.enable_steering else "off",
        "required" if api_key else "not required",
    )
    return run(app, lifecycle, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
               shutdown_timeout=args.shutdown_timeout, keep_alive_timeout=args.keep_alive_timeout,
               header_read_timeout=args.header_read_timeout, max_connections=args.max_connections, sock=sock)


def _api_key(args: argparse.Namespace) -> str | None:
    """The server's API key: --api-key, else the first line of --api-key-file, else $TAPLLM_API_KEY."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give the API key either as --api-key or as --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file} is empty")
        return key
    key = args.api_key if args.api_key is not None else os.environ.get("TAPLLM_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("the API key is empty (--api-key or $TAPLLM_API_KEY)")
    return key.strip() if key is not None else None


def _collect(args: argparse.Namespace) -> int:
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
    recipe = eagle3_cli.settings(args)
    if recipe is not None:  # the recipe reads --max-rows and --max-tokens itself
        args.max_rows, args.max_tokens = None, 0
    if dataset is None and recipe is None and (args.split != "train" or args.column != "text"):
        raise ValueError("--split and --column apply to --dataset")
    cfg = CollectConfig(
        input=args.input, dataset=dataset, out=args.out, layers=layers,
        points=[] if args.points == "none" else args.points.split(","), sae=args.sae, sae_top=args.sae_top,
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


def _model_name(model: str | None) -> str:
    """The id the server reports: the GGUF file's stem, the folder's name, or the default's."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.is_file() else path.name


def _check_save_target(path: Path, many: bool) -> None:
    """Fail before loading the model if the states could not be written."""
    if many:
        path.mkdir(parents=True, exist_ok=True)
    elif not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise FileNotFoundError(f"--save: no such directory: {path.parent}")


def _write_jsonl(rows: list[dict[str, Any]], path: Path | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if path is None:
        sys.stdout.write(text)
        return
    atomic_write(path, text)  # no half-written file is ever visible
    print(f"wrote {len(rows)} results to {path}", file=sys.stderr)
