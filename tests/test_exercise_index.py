"""Every chapter ends with exercises, at least one of them checked, and the index lists them all.

`book/exercises.md` is written from the chapters: `python -m tests.test_exercise_index` rewrites
it after a chapter's exercises change, and the test below fails until it is rewritten.
"""

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "book" / "exercises.md"
HEADING = re.compile(r"^### Exercise (\d+)\.(\d+): (.+)$", re.M)
CHECK = re.compile(r'check\("(\w+)", ')


def toc_chapters() -> list:
    """(part caption, notebook path) for every chapter notebook, in the order of _toc.yml."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [
        (part["caption"], ROOT / f"{entry['file']}.ipynb")
        for part in toc["parts"]
        for entry in part["chapters"]
        if entry["file"].startswith("notebooks/")
    ]


def source(cell) -> str:
    return "".join(cell["source"])


def anchor(title: str) -> str:
    """The id MyST gives a heading (`myst_heading_anchors`): math left out, code kept."""
    from myst_parser.mdit_to_docutils.base import default_slugify

    return default_slugify(re.sub(r"\$[^$]*\$", "", title).replace("`", ""))


def exercises(path: Path) -> list:
    """(number, title, anchor, checked names) for each exercise of a chapter."""
    cells = json.loads(path.read_text())["cells"]
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        for match in HEADING.finditer(source(cell)):
            n, k, title = match.groups()
            checked = []
            for later in cells[index + 1 :]:
                if later["cell_type"] == "markdown" and HEADING.search(source(later)):
                    break
                if later["cell_type"] == "code":
                    checked += [c for c in CHECK.findall(source(later)) if c not in checked]
            found.append((f"{n}.{k}", title, anchor(f"Exercise {n}.{k}: {title}"), checked))
    return found


def chapter_title(path: Path) -> str:
    first = source(json.loads(path.read_text())["cells"][0])
    return first.splitlines()[0].removeprefix("# ").strip()


def render() -> str:
    """The index page, from the chapters."""
    lines = [
        "# Exercises, chapter by chapter",
        "",
        "Every chapter closes with exercises. The ones marked *checked* are code you write: the",
        "cell holds a stub, and `check` runs your function against the book's on several seeded",
        "cases. When your answer is wrong and reproduces a mistake the book knows, `check` names",
        "that mistake and links the section that shows it; otherwise it says what is wrong and",
        "where. The others are derivations and measurements, with the answer folded beneath.",
    ]
    part = None
    for caption, path in toc_chapters():
        if caption != part:
            lines += ["", f"## {caption}"]
            part = caption
        number = int(path.stem.split("_")[0])
        lines += ["", f"[{number}. {chapter_title(path)}](../notebooks/{path.name})", ""]
        for ex, title, slug, checked in exercises(path):
            tail = f" (checked: {', '.join(f'`{c}`' for c in checked)})" if checked else ""
            lines.append(f"- [Exercise {ex}: {title}](../notebooks/{path.name}#{slug}){tail}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("path", [p for _, p in toc_chapters()], ids=lambda p: p.stem)
def test_every_chapter_ends_with_checked_exercises(path):
    found = exercises(path)
    number = int(path.stem.split("_")[0])
    assert found, f"{path.name} has no exercises"
    assert [ex for ex, *_ in found] == [f"{number}.{k}" for k in range(1, len(found) + 1)]
    assert 2 <= len(found) <= 4, f"{path.name}: {len(found)} exercises"
    assert any(checked for *_, checked in found), f"{path.name}: no exercise is checked"
    cells = json.loads(path.read_text())["cells"]
    last_h2 = [source(c) for c in cells if source(c).startswith("## ")][-1]
    assert last_h2.startswith("## Exercises"), "the Exercises section comes last"


def test_every_checked_exercise_exists_and_is_used_once():
    from attnlib.lab.exercises import EXERCISES

    used = [c for _, p in toc_chapters() for *_, checked in exercises(p) for c in checked]
    assert sorted(used) == sorted(set(used)), "an exercise is checked in two places"
    assert set(used) == set(EXERCISES), set(EXERCISES) ^ set(used)


def test_the_index_lists_every_exercise():
    assert INDEX.read_text() == render(), "rewrite it: python -m tests.test_exercise_index"


if __name__ == "__main__":
    INDEX.write_text(render())
    sys.exit(0)
