"""`python -m attnlib bench | check-qwen3`: see attnlib.lab.cli."""

import sys

from .lab.cli import main

sys.exit(main())
