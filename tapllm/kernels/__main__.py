"""``python -m tapllm.kernels``: build and try tapllm's CPU kernels now, not at the first start
(see :mod:`tapllm.kernels.prepare`). ``scripts/install.sh`` runs it through ``tapllm prepare``;
a ``pip install`` of tapllm runs it where torch is already installed (``setup.py``). Exit
status 1 when a compiler exists but a build or a trial fails."""

from __future__ import annotations

import argparse
import logging
import sys

from tapllm.kernels.prepare import VARIANTS, prepare_kernels


def main(argv: list[str] | None = None) -> int:
    """Build, try and report; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tapllm.kernels", description="build and try tapllm's CPU kernels")
    parser.add_argument("--variant", action="append", default=[], choices=VARIANTS,
                        help="also build this instruction-set variant (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return 0 if prepare_kernels(args.variant) else 1


if __name__ == "__main__":
    raise SystemExit(main())
