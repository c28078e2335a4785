"""Command line: the ``tapllm`` command (``main``) and its subcommands."""

from tapllm.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
