"""`python -m attnlib bench | check-qwen3 | train-lm`: see attnlib.lab.cli."""

import sys

from .lab.cli import main

sys.exit(main())
