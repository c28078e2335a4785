"""``tapllm generate`` and ``tapllm encode``: a prompt (or a JSONL file of prompts) completed, or
only its hidden states, printed or written to JSONL and safetensors files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tapllm.cli.args import SPEC_HELP, add_engine_args, add_io_args, add_sampling_args
from tapllm.utils.files import atomic_write


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the ``generate`` and ``encode`` subcommands."""
    gen = sub.add_parser("generate", help="complete a prompt, or a JSONL file of prompts")
    add_io_args(gen)
    gen.add_argument("--hidden-states", metavar="SPEC", help=SPEC_HELP)
    gen.add_argument("--save", type=Path, help="safetensors file for the states (a directory with --input)")
    gen.add_argument("--steer", type=Path, metavar="FILE", help="control vector to add: llama.cpp/repeng "
                     ".gguf or safetensors {layer: vector}")
    gen.add_argument("--steer-scale", type=float, default=1.0, help="scale of the --steer vector")
    add_engine_args(gen)
    add_sampling_args(gen)
    enc = sub.add_parser("encode", help="hidden states of a prompt (or a JSONL file of prompts), no generation")
    add_io_args(enc)
    enc.add_argument("--hidden-states", metavar="SPEC", default="", help=SPEC_HELP + " (default: all blocks' "
                     "resid_post at every position)")
    enc.add_argument("--save", type=Path, help="safetensors file for the states (a directory with --input)")
    add_engine_args(enc)


def run(args: argparse.Namespace) -> int:
    """Generate (or encode), print or write the results."""
    from tapllm.collect.prompt_records import Item, read_jsonl, to_prompt
    from tapllm.config import EngineConfig
    from tapllm.hidden_states.spec import HiddenStatesSpec
    from tapllm.hidden_states.summary import summarize
    from tapllm.llm import LLM
    from tapllm.sampling_params import SamplingParams
    from tapllm.steering.spec import Steer

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
        check_save_target(args.save, many=args.input is not None)
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
    write_jsonl(rows, args.output)
    return 0


def check_save_target(path: Path, many: bool) -> None:
    """Fail before loading the model if the states could not be written."""
    if many:
        path.mkdir(parents=True, exist_ok=True)
    elif not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise FileNotFoundError(f"--save: no such directory: {path.parent}")


def write_jsonl(rows: list[dict[str, Any]], path: Path | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if path is None:
        sys.stdout.write(text)
        return
    atomic_write(path, text)  # no half-written file is ever visible
    print(f"wrote {len(rows)} results to {path}", file=sys.stderr)
