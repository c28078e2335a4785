"""``tapllm serve``: the OpenAI-compatible HTTP server, its engine core process(es) and API servers."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
from pathlib import Path
from typing import Any

from tapllm.cli.args import add_engine_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``serve`` subcommand."""
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
    srv.add_argument("--max-connections-per-client", type=int, default=100,
                     help="open connections one client address may hold (half-open ones included), so one client "
                     "cannot take every connection; beyond: 503 at once (default 100; behind a reverse proxy every "
                     "client has the proxy's address: raise it to --max-connections)")
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
    srv.add_argument("--release-memory-after-idle", dest="release_memory_after_idle_s", type=_seconds_or_never,
                     default=10.0, metavar="SECONDS",
                     help="once no request has run for this long, hand memory back to the system: the pages of free "
                     "KV cache blocks (their cached prefixes are forgotten) and the heap's free memory (default 10; "
                     "'never' keeps it)")
    srv.add_argument("--no-engine-process", action="store_true",
                     help="run the engine on a thread of the API server's process instead of in a process of its "
                     "own (as vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    add_engine_args(srv)


def _seconds_or_never(text: str) -> float | None:
    if text == "never":
        return None
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 or 'never', got {text!r}")
    return value


def _register_saes(entries: list[str]) -> None:
    """``--sae NAME=PATH`` entries, loaded and registered before the server starts."""
    from tapllm.cli.preflight import parse_sae_entries
    from tapllm.sae.features import register_sae

    for name, path in parse_sae_entries(entries):
        logging.getLogger("tapllm").info("serving SAE %s: %r", name, register_sae(name, path))


def run(args: argparse.Namespace) -> int:
    """Serve until a signal.

    The flags, the files they name, the SAE entries and the port are checked first, in a fraction
    of a second (nothing imported yet but the standard library); then the SAEs and the model load.
    """
    from tapllm.cli.preflight import check_serve_files, parse_sae_entries, reserve_port

    if args.model is not None and args.model_path is not None:
        raise ValueError("give the model either as MODEL or as --model, not both")
    for flag in ("max_request_bytes", "max_prompts_per_request", "max_connections", "max_connections_per_client",
                 "api_server_count", "data_parallel_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("keep_alive_timeout", "header_read_timeout", "body_read_timeout", "shutdown_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.no_engine_process and (args.api_server_count != 1 or args.data_parallel_size != 1):
        raise ValueError("--api-server-count and --data-parallel-size need the engine core process: "
                         "drop --no-engine-process")
    api_key = _api_key(args)
    parse_sae_entries(args.sae)
    model = args.model_path or args.model
    check_serve_files(args, model)
    sock = reserve_port(args.host, args.port)
    try:
        return _load_and_serve(args, model, api_key, sock)
    finally:
        sock.close()


def _load_and_serve(args: argparse.Namespace, model: str | None, api_key: str | None, sock: Any) -> int:
    from tapllm.config import EngineConfig
    from tapllm.engine.llm_engine import LLMEngine

    config = EngineConfig.from_cli_args(args, model=model)
    config.validate()
    name = args.served_model_name or _model_name(model)
    # A SIGTERM while the SAEs and cores load (before uvicorn handles signals) stops the cores too.
    signal.signal(signal.SIGTERM, _stop_before_serving)
    _register_saes(args.sae)
    if args.no_engine_process:
        return _serve_app(args, LLMEngine.from_config(config), name, api_key, sock=sock)
    from tapllm.server.api_servers import serve_many
    from tapllm.server.core_client import CoreProcess, connect

    n = args.data_parallel_size
    cpus = _cpu_shares(n, args.api_server_count)
    cores: list[CoreProcess] = []
    try:
        cores.extend(CoreProcess(config, list(args.sae), args.quiet, cpus[i], i) for i in range(n))
        if args.api_server_count > 1:
            return serve_many(args.api_server_count, cores, sock, _api_server, (args, config, name, api_key))
        client = connect([c.address for c in cores], [c.pid for c in cores], config)
        logging.getLogger("tapllm").info("engine core(s) running in process(es) %s", [c.pid for c in cores])
        return _serve_app(args, client, name, api_key, sock=sock)
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
    from tapllm.engine.llm_engine import LLMEngine
    from tapllm.server import create_app, launcher
    from tapllm.utils.platform import tune_api_allocator

    if not isinstance(engine, LLMEngine):  # the engine steps in another process: large buffers go back when freed
        tune_api_allocator()
    lifecycle = launcher.Lifecycle()
    app = create_app(engine, name, api_key=api_key, max_request_bytes=args.max_request_bytes,
                     max_prompts_per_request=args.max_prompts_per_request, body_read_timeout=args.body_read_timeout,
                     lifecycle=lifecycle)
    cfg = engine.config if isinstance(engine, LLMEngine) else engine.engine.config
    logging.getLogger("tapllm").info(
        "serving %s on http://%s:%d (hidden states %s, steering %s, API key %s)", name, args.host, args.port,
        "on" if cfg.enable_hidden_states else "off", "on" if cfg.enable_steering else "off",
        "required" if api_key else "not required",
    )
    # What start-up made (torch's modules, the tokenizer, the app) lives as long as the server: frozen
    # out of the collector, so the full collection of the idle release (server/guard.py) walks only
    # what requests left.
    gc.collect()
    gc.freeze()
    return launcher.run(app, lifecycle, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                        shutdown_timeout=args.shutdown_timeout, keep_alive_timeout=args.keep_alive_timeout,
                        header_read_timeout=args.header_read_timeout, max_connections=args.max_connections,
                        max_connections_per_client=args.max_connections_per_client, sock=sock)


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


def _model_name(model: str | None) -> str:
    """The id the server reports: the GGUF file's stem, the folder's name, or the default's."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.is_file() else path.name
