import subprocess
import sys

import attnlib


def test_import_is_light():
    """`import attnlib` adds no transformers, matplotlib, ipywidgets or tqdm to what torch loads."""
    code = (
        "import sys, torch; before = set(sys.modules); import attnlib; "
        "heavy = {'transformers', 'matplotlib', 'ipywidgets', 'tqdm', 'sympy'}; "
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_version_comes_from_the_installed_metadata():
    from importlib.metadata import version

    assert attnlib.__version__ == version("attnlib") != "unknown"
