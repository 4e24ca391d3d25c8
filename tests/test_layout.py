"""The package's shape, as the book promises it: a small torch-only engine, short functions."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "attnlib"
ENGINE = sorted(PACKAGE.glob("*.py"))  # attnlib/*.py; attnlib/lab and attnlib/figures are apart
STANDARD = {"ctypes", "hashlib", "importlib", "math", "os", "shutil", "statistics", "subprocess"}
STANDARD |= {"sys", "tempfile", "typing", "pathlib", "functools", "platform"}


def imported_roots(path: Path) -> set:
    """Top-level names of absolute imports, and the first part of relative ones ('.lab' -> lab)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            roots.add(("." if node.level else "") + module)
    return roots


def test_engine_needs_only_torch_and_never_the_lab():
    for path in ENGINE:
        if path.name == "__main__.py":  # `python -m attnlib`: the door to the lab's CLI
            continue
        foreign = {
            root
            for root in imported_roots(path)
            if not root.startswith(".") and root not in STANDARD | {"torch"}
        }
        assert not foreign, f"{path.name} imports {sorted(foreign)}"
        assert not imported_roots(path) & {".lab", ".figures"}, f"{path.name} imports the lab"


def test_engine_holds_at_most_1900_lines():
    # 900 through chapter 18; the merge of partial softmaxes and L out of the tiled forward
    # added about 50, the compiled forward and backward (inner="cpp") and their loading 175.
    # Part VII added about 750: latent attention and the quantiser (chapter 23), the rescaled
    # RoPE frequencies, ALiBi and the sinks (24), linear attention and the delta rule (25).
    lines = {path.name: len(path.read_text().splitlines()) for path in ENGINE}
    assert sum(lines.values()) <= 1900, lines


def test_no_function_in_attnlib_is_over_40_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 40:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({length})")
    assert not long, long
