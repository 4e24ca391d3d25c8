"""The book reads in order: no chapter calls an `attnlib` name a later chapter introduces.

INTRODUCED says which chapter introduces each public name of the engine that a chapter's code
calls (equations are checked in test_notebooks_meta.py). A name a chapter calls that the table
lacks fails too, so the table stays complete.
"""

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import attnlib

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ENGINE_MODULES = {"attention", "cost", "data", "heads", "loops", "masks", "native", "rope"}
ENGINE_MODULES |= {"softmax", "tiled", "merge", "mla", "kv_quant", "alibi", "rope_scaling"}
ENGINE_MODULES |= {"linear_attention", "delta_rule"}

# name -> the chapter that introduces it; `module` stands for every name of that module.
INTRODUCED = {
    **dict.fromkeys(["SIX_TOKENS", "SIX_WORDS", "causal_attention", "softmax", "attention"], 1),
    "attention_weights": 2,
    "softmax_jacobian": 4,
    **dict.fromkeys(["MultiHeadAttention", "split_heads", "merge_heads"], 6),
    "score_matrix_bytes": 6,
    **dict.fromkeys(["KVCache", "left_padding", "visible", "sliding_window", "loops"], 7),
    **dict.fromkeys(["mask_of", "masks"], 7),
    "rope": 8,
    "repeat_kv": 9,
    "attention_flops": 10,
    "native": 11,
    **dict.fromkeys(["longest_fitting_length", "growth_exponent", "cost"], 13),
    "heads": 6,
    **dict.fromkeys(["tiled_attention", "tiled"], 14),
    "visible_pairs": 15,
    **dict.fromkeys(["merge_attention", "merge"], 21),
    **dict.fromkeys(["mla", "kv_quant"], 23),
    **dict.fromkeys(["alibi", "rope_scaling"], 24),
    **dict.fromkeys(["linear_attention", "delta_rule"], 25),
}


def canonical(module: str | None, name: str) -> str:
    """The table's key for `module.name`: a top-level name as itself, else the module's key."""
    if module is None or name in INTRODUCED and module in ("attention", "heads", "masks"):
        return name
    engine = importlib.import_module(f"attnlib.{module}")
    if name in attnlib.__all__ and getattr(engine, name, None) is getattr(attnlib, name):
        return name  # attnlib's own name, imported from its module
    return module


def names_called(code: str) -> set:
    """The engine names a chapter's code reaches: imported from attnlib or read off it."""
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
    tree = ast.parse(code)
    found, modules = set(), {}  # modules: local alias -> engine module name ("" = attnlib)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnlib"):
            parts = node.module.split(".")
            if len(parts) > 2 or (len(parts) == 2 and parts[1] not in ENGINE_MODULES):
                continue  # the lab and the figures are tools, not the engine's concepts
            module = parts[1] if len(parts) == 2 else None
            for alias in node.names:
                if module is None and alias.name in ENGINE_MODULES:
                    modules[alias.asname or alias.name] = alias.name
                    known = alias.name in INTRODUCED
                    found.add(canonical(None, alias.name) if known else alias.name)
                else:
                    found.add(canonical(module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "attnlib":
                    modules[alias.asname or "attnlib"] = (
                        "" if not alias.asname else ".".join(parts[1:])
                    )
                    if len(parts) == 2 and parts[1] in ENGINE_MODULES:
                        found.add(canonical(None, parts[1]))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if not isinstance(base, ast.Name) or base.id not in modules:
                continue
            path = [p for p in modules[base.id].split(".") if p] + chain
            if path[0] in ("lab", "figures"):
                continue
            if path[0] in ENGINE_MODULES:
                found.add(canonical(path[0], path[1]) if len(path) > 1 else path[0])
            else:
                found.add(path[0])
    return found


def forward_uses(chapters: dict) -> list:
    """Problems for {chapter: its code}: names used before the chapter that introduces them."""
    problems = []
    for number, code in sorted(chapters.items()):
        for name in sorted(names_called(code)):
            if name not in INTRODUCED:
                problems.append(f"chapter {number} calls attnlib's {name}, missing from INTRODUCED")
            elif INTRODUCED[name] > number:
                problems.append(
                    f"chapter {number} calls {name}, which chapter {INTRODUCED[name]} introduces"
                )
    return problems


def chapter_code(path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def chapter_number(path) -> int:
    return int(re.match(r"(\d+)_", path.name).group(1))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_chapter_calls_a_name_a_later_chapter_introduces(path):
    problems = forward_uses({chapter_number(path): chapter_code(path)})
    assert not problems, "\n".join(problems)


def test_every_introduced_name_is_called_in_its_chapter():
    """The table is true: each public name is called in the chapter said to introduce it."""
    called = {chapter_number(p): names_called(chapter_code(p)) for p in NOTEBOOKS}
    missing = [
        f"{n} (chapter {c})"
        for n, c in INTRODUCED.items()
        if n in attnlib.__all__ and n not in called.get(c, ())
    ]
    assert not missing, f"not called where INTRODUCED says it is introduced: {missing}"


def test_the_check_catches_planted_forward_uses():
    assert forward_uses({5: "from attnlib import MultiHeadAttention, softmax"}) == [
        "chapter 5 calls MultiHeadAttention, which chapter 6 introduces"
    ]
    assert forward_uses({5: "import attnlib\nattnlib.masks.visible(q, k)"}) == [
        "chapter 5 calls visible, which chapter 7 introduces"
    ]
    assert forward_uses({2: "from attnlib.rope import apply_rope"}) == [
        "chapter 2 calls rope, which chapter 8 introduces"
    ]
    assert forward_uses({8: "from attnlib import rope\nrope.apply_rope(x, c, s)"}) == []
    assert forward_uses({3: "from attnlib.lab.timing import median_seconds"}) == []
    assert forward_uses({3: "import attnlib\nattnlib.new_thing()"}) == [
        "chapter 3 calls attnlib's new_thing, missing from INTRODUCED"
    ]
