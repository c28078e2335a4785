"""Command line: ``tapllm generate``, ``encode``, ``lens``, ``features``, ``serve``, ``collect`` and ``prepare``.

One module per subcommand (``generate`` holds ``encode`` too), each with ``add_parser`` and
``run``; the flags they share are in ``args``.
"""

from tapllm.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
