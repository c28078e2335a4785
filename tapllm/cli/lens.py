"""``tapllm lens "prompt"``: the logit lens of a prompt, as a table and as pictures (PNG, HTML)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tapllm.cli.args import add_engine_args
from tapllm.tap.points import LENS_POINTS

# "final" is what the LM head reads: its lens is the model's own prediction, not a layer's.
_LENS_CHOICES = [p for p in LENS_POINTS if p != "final"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``lens`` subcommand."""
    p = sub.add_parser("lens", help="logit lens of a prompt: the top token at every layer and position")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--layers", default="all", help="block indices, e.g. 0,6,-1, or 'all'")
    p.add_argument("--point", default="resid_post", choices=_LENS_CHOICES,
                   help="the residual-stream point the lens reads (default resid_post)")
    p.add_argument("--top", type=int, default=5, help="top tokens kept per cell (the pictures show the first)")
    p.add_argument("--png", type=Path, help="write the heatmap as a PNG (matplotlib)")
    p.add_argument("--html", type=Path, help="write the heatmap as a self-contained HTML file")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    """Run the lens, print the table, write the pictures."""
    from tapllm.config import EngineConfig
    from tapllm.hidden_states.plots import lens_grid
    from tapllm.hidden_states.spec import HiddenStatesSpec
    from tapllm.llm import LLM

    layers = args.layers if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    spec = HiddenStatesSpec(layers=layers, points=[args.point], positions="prompt", lens=args.top)
    for target in (args.png, args.html):
        if target is not None and not (target.parent if str(target.parent) else Path(".")).is_dir():
            raise FileNotFoundError(f"no such directory: {target.parent}")
    llm = LLM(config=EngineConfig.from_cli_args(args))
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    out = llm.encode([prompt], spec, use_tqdm=False)[0]
    hs, tok = out.hidden_states, llm.tokenizer
    labels, positions, cells, probs = lens_grid(hs, args.point, tok)
    inputs = [tok.decode([t]) for t in out.prompt_token_ids]
    width = max(8, *(len(c) for row in cells for c in row))
    head = " " * 16 + "".join(f"{inputs[p].strip()[:width]:>{width + 1}}" for p in positions)
    lines = [head] + [f"{labels[r]:<16}" + "".join(f"{cells[r][c]:>{width + 1}}" for c in range(len(positions)))
                      for r in reversed(range(len(labels)))]
    print("\n".join(lines))
    for target in (args.png, args.html):
        if target is not None:
            hs.plot_lens(target, tokenizer=tok, point=args.point, input_tokens=out.prompt_token_ids)
            print(f"wrote {target}", file=sys.stderr)
    return 0
