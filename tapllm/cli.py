"""Command line: ``tapllm generate``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="only print results")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The ``tapllm`` argument parser."""
    parser = argparse.ArgumentParser(prog="tapllm", description="tapllm: text and hidden states in one call")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, or a JSONL file of prompts")
    gen.add_argument("prompt", nargs="?", help="prompt text (omit with --input)")
    gen.add_argument("--input", type=Path, help="JSONL file: one object per line with 'prompt', "
                     "'text', 'messages' (chat) or 'prompt_token_ids'")
    gen.add_argument("--output", type=Path, help="write JSONL results here instead of stdout")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen)
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
        return _generate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from tapllm import LLM, SamplingParams

    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a prompt or --input FILE")
    items = [_single_item(args)] if args.input is None else _read_jsonl(args.input, args.chat)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed if args.temperature else None,
    )
    llm = LLM(
        args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_cache_memory_gb,
        seed=args.seed,
    )
    prompts = [llm.apply_chat_template(it["messages"]) if "messages" in it else it["prompt"] for it in items]
    outs = llm.generate(prompts, params, use_tqdm=args.input is not None and not args.quiet)
    if args.input is None:
        print(outs[0].outputs[0].text)
        return 0
    rows = [
        {
            "index": i,
            "prompt": o.prompt,
            "text": o.outputs[0].text,
            "token_ids": o.outputs[0].token_ids,
            "finish_reason": o.outputs[0].finish_reason,
        }
        for i, o in enumerate(outs)
    ]
    _write_jsonl(rows, args.output)
    return 0


def _single_item(args: argparse.Namespace) -> dict[str, Any]:
    if args.chat:
        return {"messages": [{"role": "user", "content": args.prompt}]}
    return {"prompt": args.prompt}


def _read_jsonl(path: Path, chat: bool) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"--input: no such file: {path}")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: each line must be a JSON object")
        if "messages" in obj:
            items.append({"messages": obj["messages"]})
        elif "prompt_token_ids" in obj:
            items.append({"prompt": obj["prompt_token_ids"]})
        elif "prompt" in obj or "text" in obj:
            text = obj.get("prompt", obj.get("text"))
            items.append({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        else:
            raise ValueError(f"{path}:{n}: needs a 'prompt', 'text', 'messages' or 'prompt_token_ids' field")
    if not items:
        raise ValueError(f"--input: {path} holds no prompts")
    return items


def _write_jsonl(rows: list[dict[str, Any]], path: Path | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if path is None:
        sys.stdout.write(text)
        return
    # Write beside the target and rename, so no half-written file is ever visible.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"wrote {len(rows)} results to {path}", file=sys.stderr)
