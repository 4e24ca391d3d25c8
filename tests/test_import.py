import subprocess
import sys


def test_import_is_light():
    """`import attnlib` pulls in torch only: no transformers, matplotlib or ipywidgets."""
    code = (
        "import sys, attnlib; "
        "heavy = [m for m in ('transformers', 'matplotlib', 'ipywidgets') if m in sys.modules]; "
        "print(heavy); sys.exit(bool(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
