"""Hypothesis runs derandomized in CI, so that a submission's CI result is reproducible."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
