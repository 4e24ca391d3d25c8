"""Every chapter notebook follows the book's conventions (see the common brief).

Cell 0 links to the notebook's own page on Colab, cell 1 is the Colab set-up cell and is tagged
`remove-cell` (myst-nb leaves it out of the HTML page; it still runs in Colab and in Jupyter),
every code cell was executed in order, no output shows a memory address, and every cell whose
output nbval ignores says why, on the line after its marker.
"""

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
REPOSITORY = CONFIG["repository"]["url"].rstrip("/")  # https://github.com/ORG/REPO
BRANCH = CONFIG["repository"].get("branch", "main")
ORG_REPO = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(?:\.git)?", REPOSITORY).group(1)
ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]{4,}|\b0x7f[0-9a-fA-F]{6,}")
IGNORE = "NBVAL_IGNORE_OUTPUT"


def source(cell) -> str:
    text = cell["source"]
    return text if isinstance(text, str) else "".join(text)


def cells(path):
    return json.loads(path.read_text())["cells"]


def text_outputs(cell):
    """The text an output shows: streams, tracebacks and the text/* representations."""
    for output in cell.get("outputs", []):
        if "text" in output:
            yield source({"source": output["text"]})
        for value in output.get("traceback", []):
            yield value
        for mime, value in output.get("data", {}).items():
            if mime.startswith("text/"):
                yield source({"source": value})


def notebook_id(path):
    return path.stem


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_cell_0_is_the_title_and_its_own_colab_link(path):
    first = cells(path)[0]
    assert first["cell_type"] == "markdown", "cell 0 must be markdown"
    text = source(first)
    assert text.startswith("# "), "cell 0 must start with the chapter title, '# ...'"
    link = (
        f"https://colab.research.google.com/github/{ORG_REPO}/blob/{BRANCH}/notebooks/{path.name}"
    )
    assert f"[Open in Colab]({link})" in text, f"cell 0 must link to {link}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_cell_1_is_the_colab_set_up_cell(path):
    notebook = cells(path)
    assert len(notebook) > 1 and notebook[1]["cell_type"] == "code", "cell 1 must be code"
    text = source(notebook[1])
    assert text.startswith("# Colab set-up"), "cell 1 must start with '# Colab set-up'"
    # The repository on a line of its own, so that the cell fits the page's 80 columns.
    book, install = f'book = "{REPOSITORY}"', 'f"attnlib[book] @ git+{book}"'
    assert book in text and install in text, f"cell 1 must pip install {install}, {book}"
    guard = 'if "google.colab" in sys.modules:'
    assert guard in text, "cell 1 must install only inside Colab"
    assert text.index(guard) < text.index(book) < text.index('"pip"') < text.index(install), (
        "install is unguarded"
    )
    assert not re.search(r"[\"']torch", text), "cell 1 must leave Colab's torch alone"
    assert not notebook[1].get("outputs"), "outside Colab, cell 1 must print nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_the_colab_set_up_cell_is_left_out_of_the_page(path):
    tags = cells(path)[1].get("metadata", {}).get("tags", [])
    assert "remove-cell" in tags, "tag cell 1 'remove-cell': the HTML page does not show it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_one_top_level_heading(path):
    headings = []
    for cell in cells(path):
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in source(cell).splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            elif not fenced and re.match(r"# \S", line):
                headings.append(line)
    assert len(headings) == 1, f"expected one '# ' heading, found {headings}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_every_code_cell_was_executed_in_order(path):
    counts = [cell.get("execution_count") for cell in cells(path) if cell["cell_type"] == "code"]
    assert counts, "no code cells"
    assert counts == list(range(1, len(counts) + 1)), (
        f"execution counts {counts}: run all, in order"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_no_output_shows_a_memory_address(path):
    for number, cell in enumerate(cells(path)):
        for text in text_outputs(cell):
            found = ADDRESS.search(text)
            assert not found, f"cell {number} prints a memory address: {found.group(0)!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_every_ignored_output_says_why(path):
    for number, cell in enumerate(cells(path)):
        if cell["cell_type"] != "code":
            continue
        lines = source(cell).splitlines()
        tagged = "nbval-ignore-output" in cell.get("metadata", {}).get("tags", [])
        marked = [i for i, line in enumerate(lines) if IGNORE in line]
        if tagged and not marked:
            reasons = [line for line in lines if re.match(r"\s*#\s*\w+", line)]
            assert reasons, f"cell {number} ignores its output without a comment saying why"
        for i in marked:
            # nbval 0.11 honours the marker only alone on its comment line; with anything else
            # on that line the output is silently compared after all.
            alone = re.fullmatch(rf"\s*#+\s*{IGNORE}\s*", lines[i])
            assert alone, f"cell {number}: '# {IGNORE}' must be alone on its line (nbval)"
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            has_reason = re.match(r"#\s*\S.{8,}", following)
            assert has_reason, f"cell {number}: say why on the line after {IGNORE}"


def _equation_numbers(text: str) -> set:
    """Every 3.N cited as `eq. 3.N`, `eqs. 3.N-3.M` (both ends), `(3.N)` or `\\tag{3.N}`."""
    found = set(re.findall(r"\\tag\{(3\.\d+)\}|\((3\.\d+)\)", text))
    found = {a or b for a, b in found}
    for first, last in re.findall(r"eqs?\.\s*\(?(3\.\d+)\)?(?:\s*[-–]\s*\(?(3\.\d+))?", text):
        found |= {first, last} - {""}
    return found


def test_equation_numbers_agree_across_chapters_notation_page_and_package():
    """Chapters number their displays with \\tag{3.N}; notation.md lists exactly those numbers;
    and every number the package or a chapter cites is one of them."""
    markdown = "".join(
        source(c) for p in NOTEBOOKS for c in cells(p) if c["cell_type"] == "markdown"
    )
    tagged = set(re.findall(r"\\tag\{(3\.\d+)\}", markdown))
    numbers = sorted(tagged, key=lambda n: int(n.split(".")[1]))
    assert numbers == [f"3.{n}" for n in range(1, len(numbers) + 1)], numbers  # no gap
    notation = (ROOT / "book" / "notation.md").read_text()
    assert set(re.findall(r"^\| (3\.\d+) \|", notation, re.MULTILINE)) == tagged
    package = "".join(p.read_text() for p in (ROOT / "attnlib").rglob("*.py"))
    assert _equation_numbers(package) <= tagged, _equation_numbers(package) - tagged
    assert _equation_numbers(markdown) <= tagged, _equation_numbers(markdown) - tagged


DISPLAY = re.compile(r"\$\$(.+?)\$\$|\\begin\{(\w+\*?)\}(.+?)\\end\{\2\}", re.S)
TAG = re.compile(r"\\tag\{(3\.\d+)\}")


def display_lines(body: str) -> list:
    """The equations of one display: split at `\\\\` outside any inner environment (cases)."""
    lines, depth, start = [], 0, 0
    for match in re.finditer(r"\\begin\{|\\end\{|\\\\(?![a-zA-Z])", body):
        token = match.group(0)
        depth += 1 if token == "\\begin{" else -1 if token == "\\end{" else 0
        if token == "\\\\" and depth == 0:
            lines.append(body[start : match.start()])
            start = match.end()
    return lines + [body[start:]]


def tagged_formulas(markdown: str) -> list:
    """(number, formula) for every \\tag{3.N} in display math; the formula is the display's line
    that holds the tag, without spacing, alignment and end punctuation."""
    found = []
    for match in DISPLAY.finditer(markdown):
        for line in display_lines(match.group(1) or match.group(3)):
            for number in TAG.findall(line):
                formula = TAG.sub("", line)
                formula = re.sub(r"\\label\{[^}]*\}|\\(?:quad|qquad|,|;|!)|&|\s", "", formula)
                found.append((number, formula.rstrip(".,;")))
    return found


def reused_tags(markdown: str) -> dict:
    """Each 3.N that tags two different formulas, with the formulas."""
    formulas = {}
    for number, formula in tagged_formulas(markdown):
        formulas.setdefault(number, set()).add(formula)
    return {n: sorted(f) for n, f in formulas.items() if len(f) > 1}


def test_an_equation_number_names_one_formula_everywhere():
    """A chapter may restate an equation under its number, but never tag another formula
    with it (cite it as eq. (3.N) instead)."""
    found = {}
    for path in NOTEBOOKS:
        for cell in cells(path):
            if cell["cell_type"] == "markdown":
                for number, formula in tagged_formulas(source(cell)):
                    found.setdefault(number, {}).setdefault(formula, []).append(path.stem)
    reused = {n: f for n, f in found.items() if len(f) > 1}
    report = "\n".join(
        f"  ({n}) in {chapters}: {formula}"
        for n, formulas in sorted(reused.items())
        for formula, chapters in formulas.items()
    )
    assert not reused, (
        "one equation number tags several formulas; restate it exactly, or cite it as "
        f"eq. (3.N) without a tag:\n{report}"
    )


def test_the_equation_check_catches_a_number_reused_for_another_formula():
    home = "$$\nA = \\operatorname{softmax}(S) \\tag{4.1}\n$$"
    restated = "$$ A = \\operatorname{softmax}( S ) \\tag{4.1} $$."
    other = "\\begin{align}\nB &= C \\tag{4.2} \\\\\n"
    other += "A &= \\operatorname{softmax}(S + M) \\tag{4.1}\n\\end{align}"
    assert tagged_formulas(home) == [("3.6", "A=\\operatorname{softmax}(S)")]
    cases = "$$ m = \\begin{cases} 0 & a \\\\ 1 & b \\end{cases} \\tag{4.4} $$"
    assert tagged_formulas(cases) == [("3.9", "m=\\begin{cases}0a\\\\1b\\end{cases}")]
    assert reused_tags(home + restated) == {}
    assert reused_tags(home + other) == {
        "3.6": ["A=\\operatorname{softmax}(S)", "A=\\operatorname{softmax}(S+M)"]
    }
