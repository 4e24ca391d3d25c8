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
        if tagged:
            reasons = [line for line in lines if re.match(r"\s*#\s*\w+", line)]
            assert reasons, f"cell {number} ignores its output without a comment saying why"
        # Colab and JupyterLab show the comment to every reader; the tag stays in the metadata.
        assert not marked, f"cell {number}: tag it nbval-ignore-output, not '# {IGNORE}'"


EQ = r"\d{1,2}\.[1-9]\d?"  # N.k, k from 1


def chapter(path) -> int:
    """A notebook's chapter number, from its file name (`07_positions.ipynb` -> 7)."""
    return int(path.stem.split("_")[0])


def _equation_numbers(text: str) -> set:
    """Every N.k cited as `eq. N.k`, `eqs. N.k-N.m` (both ends), `(N.k)` or `\\tag{N.k}`."""
    found = set(re.findall(rf"\\tag\{{({EQ})\}}|\(({EQ})\)", text))
    found = {a or b for a, b in found}
    for first, last in re.findall(rf"eqs?\.\s*\(?({EQ})\)?(?:\s*[-–]\s*\(?({EQ}))?", text, re.I):
        found |= {first, last} - {""}
    return found


def _key(number: str) -> tuple:
    return tuple(int(part) for part in number.split("."))


def equation_problems(chapters: dict) -> list:
    """What breaks the book's numbering, for {chapter number: its Markdown, in reading order}.

    Chapter N tags its equations N.1, N.2, ... in reading order (a restated tag repeats an
    earlier number); every number a chapter cites is tagged in that chapter or an earlier one.
    """
    problems, defined = [], {}
    for number, markdown in sorted(chapters.items()):
        first_seen = []
        for tag in re.findall(rf"\\tag\{{({EQ})\}}", markdown):
            if _key(tag)[0] != number:
                problems.append(f"chapter {number} tags ({tag}): its tags must be {number}.k")
            elif tag not in first_seen and tag not in defined:
                first_seen.append(tag)
        expected = [f"{number}.{k}" for k in range(1, len(first_seen) + 1)]
        if first_seen != expected:
            problems.append(f"chapter {number} tags {first_seen} in reading order, not {expected}")
        defined.update({tag: number for tag in first_seen})
        for cited in sorted(_equation_numbers(markdown), key=_key):
            if cited not in defined:
                problems.append(f"chapter {number} cites ({cited}), which no chapter up to it tags")
    return problems


def chapter_markdown() -> dict:
    return {
        chapter(p): "\n".join(source(c) for c in cells(p) if c["cell_type"] == "markdown")
        for p in NOTEBOOKS
    }


def test_equations_are_numbered_by_chapter_in_reading_order():
    problems = equation_problems(chapter_markdown())
    assert not problems, "\n".join(problems)


def test_the_numbering_check_catches_a_wrong_chapter_a_gap_and_a_forward_citation():
    good = {1: "No equations; chapter 2 will derive them.", 2: "$$a \\tag{2.1}$$ $$b \\tag{2.2}$$"}
    assert equation_problems(good) == []
    assert equation_problems({**good, 1: "As eq. (2.1) will show."}) == [
        "chapter 1 cites (2.1), which no chapter up to it tags"
    ]
    assert equation_problems({2: "$$a \\tag{2.2}$$ $$b \\tag{2.1}$$"}) == [
        "chapter 2 tags ['2.2', '2.1'] in reading order, not ['2.1', '2.2']"
    ]
    assert equation_problems({3: "$$a \\tag{3.1}$$ $$b \\tag{2.2}$$"})[0] == (
        "chapter 3 tags (2.2): its tags must be 3.k"
    )
    assert equation_problems({2: "$$a \\tag{2.1}$$ $$c \\tag{2.3}$$"}) == [
        "chapter 2 tags ['2.1', '2.3'] in reading order, not ['2.1', '2.2']"
    ]


def test_the_notation_page_and_the_package_agree_with_the_chapters():
    """notation.md lists exactly the tagged numbers, by chapter; the package cites only those."""
    markdown = "".join(chapter_markdown().values())
    tagged = set(re.findall(rf"\\tag\{{({EQ})\}}", markdown))
    notation = (ROOT / "book" / "notation.md").read_text()
    listed = re.findall(rf"^\| ({EQ}) \|", notation, re.MULTILINE)
    assert set(listed) == tagged, set(listed) ^ tagged
    assert listed == sorted(listed, key=_key), "notation.md lists the equations in book order"
    # In code, `(2.5)` may be a number: the package's citations are those after "eq."
    package = "".join(p.read_text() for p in (ROOT / "attnlib").rglob("*.py"))
    lists = re.findall(
        r"eqs?\.\s*((?:\(?\d{1,2}\.\d+\)?(?:,\s*|\s*[-–/]\s*|\s+and\s+)?)+)", package, re.I
    )
    cited = {number for found in lists for number in re.findall(EQ, found)}
    assert cited <= tagged, cited - tagged


DISPLAY = re.compile(r"\$\$(.+?)\$\$|\\begin\{(\w+\*?)\}(.+?)\\end\{\2\}", re.S)
TAG = re.compile(r"\\tag\{(\d{1,2}\.\d+)\}")


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
    """(number, formula) for every \\tag{N.k} in display math; the formula is the display's line
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
    """Each N.k that tags two different formulas, with the formulas."""
    formulas = {}
    for number, formula in tagged_formulas(markdown):
        formulas.setdefault(number, set()).add(formula)
    return {n: sorted(f) for n, f in formulas.items() if len(f) > 1}


def test_an_equation_number_names_one_formula_everywhere():
    """A chapter may restate an equation under its number, but never tag another formula
    with it (cite it as eq. (N.k) instead)."""
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
        f"eq. (N.k) without a tag:\n{report}"
    )


def test_the_equation_check_catches_a_number_reused_for_another_formula():
    home = "$$\nA = \\operatorname{softmax}(S) \\tag{4.1}\n$$"
    restated = "$$ A = \\operatorname{softmax}( S ) \\tag{4.1} $$."
    other = "\\begin{align}\nB &= C \\tag{4.2} \\\\\n"
    other += "A &= \\operatorname{softmax}(S + M) \\tag{4.1}\n\\end{align}"
    assert tagged_formulas(home) == [("4.1", "A=\\operatorname{softmax}(S)")]
    cases = "$$ m = \\begin{cases} 0 & a \\\\ 1 & b \\end{cases} \\tag{4.4} $$"
    assert tagged_formulas(cases) == [("4.4", "m=\\begin{cases}0a\\\\1b\\end{cases}")]
    assert reused_tags(home + restated) == {}
    assert reused_tags(home + other) == {
        "4.1": ["A=\\operatorname{softmax}(S)", "A=\\operatorname{softmax}(S+M)"]
    }


# The page shows the idea; checks are folded beneath it (a cell tagged hide-input shows only a
# "show code" toggle) or removed from the page.
FOLDED = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
MAX_VISIBLE_LINES = 25


def long_visible_cells(notebook_cells) -> list:
    """(cell index, lines) of every code cell the page shows in full that is over the budget."""
    return [
        (index, len(source(cell).splitlines()))
        for index, cell in enumerate(notebook_cells)
        if cell["cell_type"] == "code"
        and not FOLDED & set(cell.get("metadata", {}).get("tags", []))
        and len(source(cell).splitlines()) > MAX_VISIBLE_LINES
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_no_visible_code_cell_is_over_25_lines(path):
    found = long_visible_cells(cells(path))
    assert not found, (
        f"visible code cells over {MAX_VISIBLE_LINES} lines (cell, lines): {found}; keep the idea "
        "on the page and fold the checks into a cell tagged hide-input below it"
    )


def test_the_budget_check_catches_a_long_visible_cell_and_spares_a_folded_one():
    long = {"cell_type": "code", "metadata": {}, "source": "x = 1\n" * 26}
    short = {"cell_type": "code", "metadata": {}, "source": "x = 1\n" * 25}
    folded = {"cell_type": "code", "metadata": {"tags": ["hide-input"]}, "source": long["source"]}
    assert long_visible_cells([short, long, folded]) == [(1, 26)]


# Words for the book's machinery, which a reader of a chapter never needs.
MACHINERY = [
    (re.compile(r"\bnbval\b", re.I), "nbval"),
    (re.compile(r"\bNBVAL_\w+"), "an nbval marker"),
    (re.compile(r"\bCI\b"), "CI"),
    (re.compile(r"\btest[-\s]suite\b|\bunit[- ]tests?\b|\bpytest\b", re.I), "the tests"),
    (re.compile(r"\bhypothesis\b", re.I), "hypothesis"),
    (re.compile(r"\btests?/\w|\btest_\w+", re.I), "a test file"),
    (re.compile(r"\bexit (?:code|status)\b", re.I), "an exit code"),
    (re.compile(r"</?[a-z][a-z0-9]*\b[^>]*>|&lt;\w", re.I), "HTML"),
    (re.compile(r"`[^`]*<[a-z/][^`]*`", re.I), "HTML"),
    (re.compile(r"\bthe (?:seed|source text|source chapters?|draft)s?\b", re.I), "the source"),
    (re.compile(r"\berrat(?:a|um)\b|\bcorrections? to the source\b", re.I), "the corrections"),
    (re.compile(r"errata\.md"), "a link to the corrections"),
]


# The one piece of HTML a chapter holds: the fold of an answer, which Jupyter, Colab and the
# book all render as "▶ Answer" (tests/test_answers.py checks its form).
ANSWER_FOLD = re.compile(r"^<details><summary>Answer</summary>$|^</details>$", re.M)


def machinery_words(markdown: str) -> list:
    """The machinery words a chapter's Markdown shows its reader (code blocks included)."""
    markdown = ANSWER_FOLD.sub("", markdown)
    return list(dict.fromkeys(name for pattern, name in MACHINERY if pattern.search(markdown)))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_chapter_prose_speaks_to_the_reader(path):
    found = {
        index: machinery_words(source(cell))
        for index, cell in enumerate(cells(path))
        if cell["cell_type"] == "markdown" and machinery_words(source(cell))
    }
    assert not found, (
        f"chapter prose names the book's machinery (cell: words): {found}; "
        "book/setup.md tells contributors how the book is tested"
    )


def test_the_machinery_check_catches_planted_words():
    assert machinery_words('It was <span class="given">0.139</span> here.') == ["HTML"]
    assert machinery_words("A random seed of 0, a head count and a hypothesis-free claim.") == [
        "hypothesis"
    ]
    assert machinery_words("We run the test on the function; the test can fail.") == []
    assert machinery_words("Run under nbval, the test suite checks it in CI.") == [
        "nbval",
        "CI",
        "the tests",
    ]
    assert machinery_words("See `tests/test_stretch.py`; it stops with exit code 2.") == [
        "a test file",
        "an exit code",
    ]
    assert machinery_words("Scores of 4 < 5 and 6 > 2 are no markup.") == []
    assert machinery_words('Write `<span class="given">` around it.') == ["HTML"]
    assert machinery_words("The source text has an erratum; see [it](../book/errata.md).") == [
        "the source",
        "the corrections",
        "a link to the corrections",
    ]
    assert machinery_words("Attention, then a <div>.") == ["HTML"]
    assert machinery_words("<details><summary>Answer</summary>\n\nIt is 3.\n\n</details>") == []
    assert machinery_words("<details open><summary>Answer</summary>") == ["HTML"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_printed_lines_fit_the_page(path):
    """A printed line over 80 characters scrolls sideways in the book's 80-column cells."""
    wide = [
        (number, line[:60])
        for number, cell in enumerate(cells(path))
        for text in text_outputs(cell)
        for line in text.splitlines()
        if len(line) > 80 and not line.startswith("<")  # HTML reprs wrap by themselves
    ]
    assert not wide, f"printed lines over 80 characters (cell, start): {wide}"


def fenced_lines(markdown: str) -> list:
    """The lines inside the ``` fences of a cell's markdown (an answer's code, a command)."""
    inside, lines = False, []
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_code_in_the_prose_fits_the_page(path):
    """An answer's code and a command in the prose keep to the 80 columns of a code cell."""
    wide = [
        (number, line[:60])
        for number, cell in enumerate(cells(path))
        if cell["cell_type"] == "markdown"
        for line in fenced_lines(source(cell))
        if len(line) > 80
    ]
    assert not wide, f"lines over 80 characters in fenced code (cell, start): {wide}"


def test_the_fence_reader_finds_the_code_lines():
    text = "prose\n```python\nx = 1\n```\n\n```text\n" + "9" * 81 + "\n```\nmore prose"
    assert fenced_lines(text) == ["x = 1", "9" * 81]
