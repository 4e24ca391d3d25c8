"""Exercises stay exercises where readers run them; every folded answer is still checked.

Colab and JupyterLab ignore Jupyter Book's cell tags and run every code cell on "Run all", so an
answer is never a code cell: it is a `<details><summary>Answer</summary>` block in markdown,
folded in Jupyter, Colab and the HTML book alike, and never executed by them. Here each answer's
```python blocks run in a fresh namespace, in order (so one answer is self-contained), every
`check` they call must pass, and a ```text block right after a python block is what that block
prints, compared exactly.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXERCISE = re.compile(r"^### Exercise (\d+\.\d+)", re.M)
DETAILS = re.compile(r"<details><summary>Answer</summary>\n(.*?)\n</details>", re.S)
BLOCK = re.compile(r"^```(python|text)\n(.*?)^```$", re.S | re.M)
CHECK = re.compile(r'check\(\s*"(\w+)"')
VERDICT = re.compile(r"^(\w+): (passed|not yet)\b", re.M)


def cells(path: Path) -> list:
    return json.loads(path.read_text())["cells"]


def source(cell) -> str:
    return "".join(cell["source"])


def printed(cell) -> str:
    """What a code cell's stored outputs show as text (streams and plain-text displays)."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append("".join(out.get("text", "")))
        parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def exercises(path: Path) -> list:
    """For each exercise: (number, its markdown, the checks its code cells call)."""
    found = []
    for cell in cells(path):
        text = source(cell)
        if cell["cell_type"] == "markdown":
            pieces = EXERCISE.split(text)
            if found:
                found[-1][1].append(pieces[0])
            for number, body in zip(pieces[1::2], pieces[2::2]):
                found.append((number, [body], []))
        elif found:
            found[-1][2].extend(CHECK.findall(text))
    return [(number, "\n".join(md), checks) for number, md, checks in found]


def answers(path: Path) -> list:
    """(exercise number, [(kind, code)]) for every folded answer of a chapter."""
    return [
        (
            number,
            [(kind, code) for block in DETAILS.findall(md) for kind, code in BLOCK.findall(block)],
        )
        for number, md, _ in exercises(path)
    ]


def test_there_are_answers():
    assert len(NOTEBOOKS) >= 20
    assert sum(len(exercises(p)) for p in NOTEBOOKS) >= 60


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_build_syntax_in_the_markdown(path):
    markdown = "\n".join(source(c) for c in cells(path) if c["cell_type"] == "markdown")
    for pattern in (r"^:::\{", r"^```\{", r"^\([^)\n]*\)=\s*$"):
        found = re.findall(pattern, markdown, re.M)
        assert not found, f"{path.name}: {found[:3]} shows as raw text in Jupyter and Colab"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_has_one_folded_answer(path):
    for number, md, _ in exercises(path):
        assert len(DETAILS.findall(md)) == 1, f"exercise {number}: one <details> answer block"
        assert ":::" not in md and "dropdown" not in md, f"exercise {number}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_run_all_leaves_the_stubs_and_no_verdict_says_passed(path):
    """Run all, as Colab does: each checked stub still says "not yet"; no answer ran."""
    defined = {}
    for cell in cells(path):
        if cell["cell_type"] != "code":
            continue
        text = source(cell)
        for name in re.findall(r"^def (my_\w+)\(", text, re.M):
            defined[name] = defined.get(name, 0) + 1
        verdicts = VERDICT.findall(printed(cell))
        assert len(verdicts) == len(CHECK.findall(text)), f"{path.name}: {text[:80]!r}"
        assert all(v == "not yet" for _, v in verdicts), f"{path.name}: {verdicts}"
        assert "hide-cell" not in cell["metadata"].get("tags", []) or not CHECK.search(text)
    again = [name for name, n in defined.items() if n > 1]
    assert not again, f"{path.name}: {again} defined again after the stub: Run all overwrites it"
    for number, _, checks in exercises(path):
        for name in checks:
            assert f'check("{name}"' in "".join(
                code for n, blocks in answers(path) if n == number for _, code in blocks
            ), f"exercise {number}: its answer does not run check({name!r}, ...)"


# Runs one chapter's answers in a fresh Python, so that they neither see nor change the state of
# the test process (threads, seeds, the allocator's free memory), and reports as JSON.
DRIVER = """
import contextlib, io, json, sys, traceback
from attnlib.lab import exercises as bank

real_check, results, report = bank.check, [], {"errors": [], "mismatches": []}


def recording_check(name, fn, *args, **kwargs):
    result = real_check(name, fn, *args, **kwargs)
    results.append((name, result.passed))
    return result


bank.check = recording_check
for number, blocks in json.load(sys.stdin):
    namespace, last_output = {"__name__": "answer_" + number.replace(".", "_")}, None
    for kind, code in blocks:
        if kind == "text":
            if last_output is None or last_output.rstrip() != code.rstrip():
                report["mismatches"].append([number, last_output, code])
            last_output = None
            continue
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compile(code, "<answer " + number + ">", "exec"), namespace)
        except BaseException:
            report["errors"].append([number, traceback.format_exc()])
            break
        last_output = buffer.getvalue()
report["results"] = results
print("\\nREPORT " + json.dumps(report))
"""


def run_answers(path: Path) -> dict:
    """Every answer of a chapter run in a fresh Python: errors, text mismatches, check results."""
    done = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(answers(path)),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.rsplit("\nREPORT ", 1)[1])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_answer_runs_and_passes(path):
    report = run_answers(path)
    assert not report["errors"], f"{path.name}: an answer raised: {report['errors']}"
    for number, printed, shown in report["mismatches"]:
        raise AssertionError(
            f"exercise {number} prints\n{printed}\nnot what its answer shows\n{shown}"
        )
    failed = [name for name, passed in report["results"] if not passed]
    assert not failed, f"{path.name}: answers that do not pass: {failed}"
    checked = {name for _, _, checks in exercises(path) for name in checks}
    ran = {name for name, _ in report["results"]}
    assert checked <= ran, f"{path.name}: no answer runs check for {checked - ran}"


def test_the_answer_check_can_fail(tmp_path):
    """A wrong answer, a missing answer and a stub overwritten by Run all are all caught."""
    stub = {
        "cell_type": "code",
        "metadata": {},
        "source": 'def my_f(x):\n    raise NotImplementedError\n\n\ncheck("softmax", my_f)\n',
        "outputs": [{"output_type": "stream", "name": "stdout", "text": "softmax: passed\n"}],
    }
    heading = {"cell_type": "markdown", "metadata": {}, "source": "### Exercise 1.1: x\n"}
    book = tmp_path / "01_x.ipynb"
    book.write_text(json.dumps({"cells": [heading, stub]}))
    with pytest.raises(AssertionError):
        test_every_exercise_has_one_folded_answer(book)
    with pytest.raises(AssertionError):
        test_run_all_leaves_the_stubs_and_no_verdict_says_passed(book)
    wrong = (
        "<details><summary>Answer</summary>\n\n```python\n"
        "import torch\nfrom attnlib.lab.exercises import check\n\n\n"
        "def my_f(z):\n    return torch.softmax(z, dim=0)\n\n\n"
        'check("stable_softmax", my_f)\n```\n\n</details>'
    )
    heading["source"] += "\n" + wrong + "\n"
    stub["source"] = stub["source"].replace('"softmax"', '"stable_softmax"')
    book.write_text(json.dumps({"cells": [heading, stub]}))
    with pytest.raises(AssertionError, match="do not pass"):
        test_every_answer_runs_and_passes(book)
    heading["source"] = heading["source"].replace(
        "```\n\n</details>", "```\n\n```text\n1\n```\n\n</details>"
    )
    book.write_text(json.dumps({"cells": [heading, stub]}))
    with pytest.raises(AssertionError, match="not what its answer shows"):
        test_every_answer_runs_and_passes(book)
