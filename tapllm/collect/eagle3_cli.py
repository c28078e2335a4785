"""The ``tapllm collect`` options of ``--recipe eagle3`` (see :mod:`tapllm.collect.eagle3`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tapllm.collect.eagle3 import Eagle3Settings

# The recipe module imports torch; the parser is built before torch is imported (tapllm.cli),
# so the layouts are named here and checked against eagle3.FORMATS by a test.
FORMATS = ("speculators", "specforge", "tapllm")


def add_arguments(col: argparse.ArgumentParser) -> None:
    """The recipe's options, on the ``collect`` subcommand."""
    g = col.add_argument_group("--recipe eagle3 (EAGLE-3 drafter training data from chat conversations)")
    g.add_argument("--recipe", choices=["eagle3"], default=None,
                   help="eagle3: --input / --dataset hold conversations (ShareGPT 'conversations', UltraChat "
                   "'messages' or 'data'); writes the aux layers and the last layer at every position, loss_mask "
                   "over assistant tokens, token frequencies and d2t/t2d, in speculators' and SpecForge's layouts")
    g.add_argument("--aux-layers", default=None, metavar="K,K,K",
                   help="the three auxiliary layers (the input of these blocks; default EAGLE-3's 2,L/2,L-3)")
    g.add_argument("--eagle3-formats", default="speculators,specforge",
                   help=f"layouts written under --out: some of {', '.join(FORMATS)} (default speculators,specforge)")
    g.add_argument("--regenerate", action="store_true",
                   help="write every assistant turn anew with the target model (--max-tokens per reply, default 512)")
    g.add_argument("--temperature", type=float, default=0.0, help="--regenerate sampling (0 = greedy; --seed)")
    g.add_argument("--top-p", type=float, default=1.0, help="--regenerate sampling")
    g.add_argument("--draft-vocab-size", type=int, default=32000, help="draft vocabulary of d2t/t2d (default 32000)")


def settings(args: argparse.Namespace) -> Eagle3Settings | None:
    """The recipe's settings from the command line (``None`` without ``--recipe``)."""
    if args.recipe is None:
        return None
    from tapllm.collect.eagle3 import Eagle3Settings

    aux = None
    if args.aux_layers is not None:
        try:
            aux = [int(x) for x in args.aux_layers.split(",")]
        except ValueError:
            raise ValueError(f"--aux-layers must be three comma-separated integers, got {args.aux_layers!r}") from None
    return Eagle3Settings(aux_layers=aux, formats=tuple(f for f in args.eagle3_formats.split(",") if f),
                          regenerate=args.regenerate, max_new_tokens=args.max_tokens or 512,
                          temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                          draft_vocab_size=args.draft_vocab_size,
                          column=None if args.column == "text" else args.column, max_conversations=args.max_rows)
