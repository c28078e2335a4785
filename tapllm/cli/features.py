"""``tapllm features "prompt" --sae PATH``: the SAE features of every token, as a table and an HTML page."""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path
from typing import Any

from tapllm.cli.args import add_engine_args
from tapllm.utils.files import atomic_write


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``features`` subcommand."""
    p = sub.add_parser("features", help="SAE features of every token of a prompt (and of what the model generates)")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--sae", required=True, help="SAE folder, file (params.npz) or hub id (SAELens, sparsify, "
                                                "Gemma Scope)")
    p.add_argument("--hookpoint", help="the sparsify hookpoint folder, when the SAE folder holds several")
    p.add_argument("--top", type=int, default=10, help="top features shown per token (default 10)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="also generate this many tokens (greedy) and show their features (default 0: the prompt)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--html", type=Path, help="write the table as a self-contained HTML page")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    """Encode (or generate), print the per-token table, write the HTML page."""
    from tapllm.config import EngineConfig
    from tapllm.hidden_states.spec import HiddenStatesSpec
    from tapllm.llm import LLM
    from tapllm.sae.model import SAE
    from tapllm.sampling_params import SamplingParams

    if not 1 <= args.top <= 1024:
        raise ValueError(f"--top must be in [1, 1024], got {args.top}")
    if args.html is not None and not (args.html.parent if str(args.html.parent) else Path(".")).is_dir():
        raise FileNotFoundError(f"no such directory: {args.html.parent}")
    hub = None if Path(args.sae).expanduser().exists() else getattr(args, "download_dir", None)
    sae = SAE.load(args.sae, hookpoint=args.hookpoint, download_dir=hub)
    llm = LLM(config=EngineConfig.from_cli_args(args))
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    spec = HiddenStatesSpec(sae=sae, features=f"topk:{args.top}")
    if args.max_tokens > 0:
        out = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0, hidden_states=spec),
                           use_tqdm=False)[0]
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
    else:
        out = llm.encode([prompt], spec, use_tqdm=False)[0]
        tokens = out.prompt_token_ids
    f = out.hidden_states.features
    texts = [llm.tokenizer.decode([t]) for t in tokens]
    print(f"# {sae!r}", file=sys.stderr)
    print(feature_table(f, texts, len(out.prompt_token_ids)))
    if args.html is not None:
        save_features_html(f, texts, args.html, title=repr(sae), num_prompt=len(out.prompt_token_ids))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _show(text: str, width: int = 14) -> str:
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    if not text.strip():
        text = text.replace(" ", "\u2423") or "\u2205"
    return text if len(text) <= width else text[: width - 1] + "…"


def feature_table(f: Any, texts: list[str], num_prompt: int) -> str:
    """One line per position: position, token, reconstruction error norm, then ``id:activation`` of the top features."""
    lines = [f"{'pos':>5} {'token':<15} {'|err|':>8}  top features (id:activation)"]
    for row, pos in enumerate(f.positions.tolist()):
        mark = " " if pos < num_prompt else "*"
        feats = "  ".join(f"{int(i)}:{float(v):.3g}" for i, v in zip(f.ids[row], f.values[row]) if float(v) > 0)
        lines.append(f"{pos:>4}{mark} {_show(texts[pos]):<15} {float(f.error_norm[row]):>8.3g}  {feats or '-'}")
    return "\n".join(lines)


def save_features_html(f: Any, texts: list[str], path: str | Path, title: str = "SAE features",
                       num_prompt: int | None = None) -> Path:
    """The per-token top features as a self-contained HTML table, cells shaded by activation (hover: value)."""
    peak = float(f.values.max()) if f.values is not None and f.values.numel() else 1.0
    rows = []
    for row, pos in enumerate(f.positions.tolist()):
        cells = []
        for i, v in zip(f.ids[row].tolist(), f.values[row].tolist()):
            if v <= 0:
                cells.append("<td></td>")
                continue
            shade = int(255 - 200 * min(1.0, v / peak if peak > 0 else 0.0))
            color = "#fff" if shade < 120 else "#000"
            cells.append(f'<td style="background:rgb(255,{shade},{shade});color:{color}" title="{v:.4g}">{i}</td>')
        generated = num_prompt is not None and pos >= num_prompt
        tok = html.escape(_show(texts[pos], 20))
        rows.append(f"<tr><th>{pos}</th><th{' class=gen' if generated else ''}>{tok}</th>"
                    f"<td>{float(f.error_norm[row]):.3g}</td>{''.join(cells)}</tr>")
    k = f.ids.shape[1] if f.ids is not None else 0
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>SAE features</title>
<style>body{{font-family:sans-serif}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:3px 5px;text-align:center;white-space:nowrap}} th.gen{{color:#06c}}</style></head>
<body><h3>{html.escape(title)}</h3><p>Top {k} features per token, shaded by activation (hover a cell for its value);
generated tokens in blue; |err| is the reconstruction error norm.</p>
<table><thead><tr><th>pos</th><th>token</th><th>|err|</th>{''.join(f'<th>#{j + 1}</th>' for j in range(k))}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table></body></html>
"""
    return atomic_write(Path(path), doc)
