"""``python -m tapllm`` runs the command line."""

import sys

from tapllm.cli import main

if __name__ == "__main__":  # not when a spawned child (the engine core) imports this module again
    sys.exit(main())
