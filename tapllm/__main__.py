"""``python -m tapllm`` runs the command line."""

import sys

from tapllm.cli import main

sys.exit(main())
