"""`python -m attnlib bench | check-qwen3 | train-lm | bench-fusion`: see attnlib.lab.cli."""

import sys

from .lab.cli import main

sys.exit(main())
