"""Pictures of captured states: the logit lens as a heatmap (PNG with matplotlib, or self-contained
HTML), and the norm of the residual stream per layer.

A lens picture has one row per layer (the top is the last layer) and one column per position;
each cell names the top token the lens predicts there and is coloured by its probability.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from tapllm.hidden_states.lens import Lens
from tapllm.utils.files import atomic_write


class HiddenStates(Protocol):
    """What the pictures read of a ``HiddenStates`` (the result module calls this one, not the reverse)."""

    lens: Lens | None
    reduce: str | None
    layers: list[int]
    positions: torch.Tensor

    @property
    def points(self) -> tuple[str, ...]: ...

    def __getitem__(self, point: str) -> torch.Tensor: ...


def _matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install 'tapllm[plot]' (or pip install matplotlib)") from None
    return plt


def _decoder(tokenizer: Any) -> Callable[[int], str]:
    if tokenizer is None:
        return lambda t: f"#{t}"
    return lambda t: tokenizer.decode([t])


def _show(text: str, width: int = 10) -> str:
    """A token as a cell label: whitespace made visible, long tokens cut."""
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    if not text.strip():
        text = text.replace(" ", "\u2423") or "\u2205"  # visible space; empty set for an empty token
    return text if len(text) <= width else text[: width - 1] + "…"


def lens_grid(hs: HiddenStates, point: str | None, tokenizer: Any
              ) -> tuple[list[str], list[int], list[list[str]], torch.Tensor]:
    """(row labels, positions, top-token labels [layers][positions], top-1 probabilities [layers, positions])."""
    if hs.lens is None:
        raise ValueError("these hidden states carry no logit lens: capture them with lens=k")
    if hs.reduce is not None:
        raise ValueError("a lens picture needs one row per position: capture without reduce")
    point = point or next(iter(hs.lens))
    res = hs.lens[point]
    decode = _decoder(tokenizer)
    ids = res.token_ids[:, :, 0].T  # [layers, positions]
    probs = res.logprobs[:, :, 0].T.float().exp()
    layers = hs.layers if point not in ("embed", "final") else [point]
    labels = [f"{point} {layer}" if isinstance(layer, int) else layer for layer in layers]
    cells = [[_show(decode(int(t))) for t in row] for row in ids.tolist()]
    return labels, hs.positions.tolist(), cells, probs


def save_lens_png(hs: HiddenStates, path: str | Path, tokenizer: Any = None, point: str | None = None,
                  input_tokens: Sequence[int] | None = None) -> Path:
    """The lens heatmap as a PNG (matplotlib); ``input_tokens`` label the positions."""
    plt = _matplotlib()
    labels, positions, cells, probs = lens_grid(hs, point, tokenizer)
    decode = _decoder(tokenizer)
    n_layers, n_pos = probs.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * n_pos + 2.5), max(3.0, 0.38 * n_layers + 1.5)))
    im = ax.imshow(probs.flip(0).numpy(), aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0)
    for r in range(n_layers):
        for c in range(n_pos):
            p = float(probs[n_layers - 1 - r, c])
            ax.text(c, r, cells[n_layers - 1 - r][c], ha="center", va="center", fontsize=7,
                    color="white" if p > 0.6 else "black")
    ax.set_yticks(range(n_layers), list(reversed(labels)), fontsize=7)
    xlabels = [f"{p}" for p in positions]
    if input_tokens is not None:
        xlabels = [f"{_show(decode(int(input_tokens[p])), 8)}\n{p}" if p < len(input_tokens) else f"{p}"
                   for p in positions]
    ax.set_xticks(range(n_pos), xlabels, fontsize=7)
    ax.set_title("logit lens: top token and its probability at each layer and position", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.025, pad=0.01, label="probability")
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return path


def save_lens_html(hs: HiddenStates, path: str | Path, tokenizer: Any = None, point: str | None = None,
                   input_tokens: Sequence[int] | None = None) -> Path:
    """The lens heatmap as one self-contained HTML file (a table; hover a cell for the top-k)."""
    labels, positions, cells, probs = lens_grid(hs, point, tokenizer)
    decode = _decoder(tokenizer)
    res = hs.lens[point or next(iter(hs.lens))]
    head = "".join(
        f"<th>{html.escape(_show(decode(int(input_tokens[p])), 12)) if input_tokens is not None and p < len(input_tokens) else ''}"
        f"<br><small>{p}</small></th>" for p in positions)
    rows = []
    for r in reversed(range(len(labels))):
        tds = []
        for c in range(len(positions)):
            p = float(probs[r, c])
            alternatives = ", ".join(f"{_show(decode(int(t)), 16)} {math.exp(v):.2f}"
                                     for t, v in zip(res.token_ids[c, r].tolist(), res.logprobs[c, r].tolist()))
            shade = int(255 - 200 * p)
            color = "#fff" if p > 0.6 else "#000"
            tds.append(f'<td style="background:rgb({shade},{shade},255);color:{color}" '
                       f'title="{html.escape(alternatives)}">{html.escape(cells[r][c])}<br><small>{p:.2f}</small></td>')
        rows.append(f"<tr><th>{html.escape(labels[r])}</th>{''.join(tds)}</tr>")
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>logit lens</title>
<style>body{{font-family:sans-serif}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:3px 5px;text-align:center;white-space:nowrap}}</style></head>
<body><h3>Logit lens: top token and its probability at each layer (rows) and position (columns)</h3>
<table><thead><tr><th></th>{head}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table></body></html>
"""
    return atomic_write(Path(path), doc)


def save_norms_png(hs: HiddenStates, path: str | Path, point: str | None = None) -> Path:
    """The L2 norm of a captured point's states per layer, one line per position (mean in bold)."""
    plt = _matplotlib()
    point = point or hs.points[0]
    states = hs[point].float()
    if hs.reduce is not None:
        states = states[None]
    norms = states.norm(dim=-1)  # [positions, layers]
    layers = list(range(norms.shape[1]))
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in norms:
        ax.plot(layers, row.numpy(), color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(layers, norms.mean(0).numpy(), color="tab:red", linewidth=2.0, label="mean over positions")
    names = hs.layers if len(hs.layers) == norms.shape[1] else layers
    ax.set_xticks(layers, [str(x) for x in names], fontsize=7)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"|{point}|")
    ax.set_title(f"norm of {point} per layer", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return path
