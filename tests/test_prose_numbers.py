"""Every number in a notebook's running prose is printed by one of its cells, at that precision.

How a number is read. The prose is the Markdown cells less math, code, links and raw HTML
(tests/markdown_prose.py). A number is a run of digits with an optional decimal part and
exponent, `1,024` meaning 1024; a sign is ignored, and `2x`, `x4` and `×4` count as 2 and 4. It
must appear among the numbers printed by the notebook's code cells, written the same way: `0.33`
matches a printed `0.33` or `3.3e-01`, but not `0.330`, `0.3` or `0.331`; `24` does not match a
printed `23.5`. Only outputs that nbval compares count: not those of a cell marked
NBVAL_IGNORE_OUTPUT or NBVAL_SKIP, nor of a cell stored unexecuted. A number printed only by a
machine-dependent cell would go stale the day the book is rebuilt on another machine.

Exempt, because they are labels rather than results:
* numbers inside math (`$...$`, `$$...$$`, `\\begin{...}`), code spans and code blocks, URLs;
  but inline math that only states a value, `$M = 24$` or `$d = 1{,}024$`, is prose and checked;
* equation numbers: `(2.2)`, and any number after "eq.", "eqs.", "equation(s)", with lists and
  ranges such as "eqs. (6.1)-(6.2)";
* references to parts of a text: a number or list of numbers after chapter, part, section, step,
  exercise, question, erratum, cell, page, pp., figure, table, or §;
* versions: `2.13.0`, `4.x`, and a number right after a package's name (torch, PyTorch, Python,
  transformers, ipywidgets, ...) or after `>=`;
* years, 1990 to 2030, written without a thousands comma;
* the whole numbers 0 to 10 (not before `%`): counts and constants ("2 heads", "mean 0 and
  variance 1"); a claim resting on one of them is asserted by its cell instead;
* digits inside a word or a name: `float32`, `Qwen3-0.6B`, `2nd`.

A number that is given rather than measured (a value quoted from the seed drafts, an assumed
machine size, a hypothetical) is wrapped as `<span class="given">1.5</span>`. The span renders
as the bare number in Jupyter and in the built book (test_the_given_marker_is_invisible); the
test counts these numbers and prints the count, which must stay small (MAX_GIVEN).
"""

import configparser
import re
from decimal import Decimal
from pathlib import Path

import nbformat
import pytest

from tests.markdown_prose import (
    GIVEN_CLOSE,
    GIVEN_OPEN,
    cell_source,
    notebook_cells,
    notebooks,
    prose_blocks,
)

MAX_GIVEN = 30
SANITIZE = Path(__file__).resolve().parent / "nbval-sanitize.cfg"
# nbval 0.11 honours a marker only on a comment line of its own: `# NBVAL_IGNORE_OUTPUT`.
IGNORED = re.compile(r"^\s*#+\s*(?:NBVAL_IGNORE_OUTPUT|NBVAL_SKIP)\s*$", re.M)
IGNORED_TAGS = {"nbval-ignore-output", "nbval-skip"}

_LIST = r"(?:\s*(?:,|and|or|to|-|–|—)\s*\(?\d+(?:\.\d+)*\)?)*"
EXEMPT = [
    # (2.2), (2.1, 3.3)
    re.compile(r"\(\d{1,2}\.\d{1,2}(?:\s*(?:,|and|-|–)\s*\d{1,2}\.\d{1,2})*\)"),
    re.compile(r"\b(?:eqs?\.|equations?)\s*\(?\d+(?:\.\d+)*\)?" + _LIST, re.I),
    re.compile(
        r"(?:\b(?:chapters?|parts?|sections?|steps?|exercises?|questions?|errat(?:um|a)|cells?"
        r"|pages?|pp?\.|figures?|tables?)|§)\s*\d+(?:\.\d+)*" + _LIST,
        re.I,
    ),
    re.compile(
        r"(?:\b(?:torch|pytorch|python|transformers|ipywidgets|jupyter[- ]book|nbval|matplotlib"
        r"|pytest|sphinx|myst-nb|mathjax|numpy|cuda|version)\s+v?|>=\s*|\bv)\d+(?:\.\d+)*(?:\.x)?",
        re.I,
    ),
    re.compile(r"\b\d+(?:\.\d+)+\.(?:\d+|x)\b"),  # 2.13.0, 4.51.x
    re.compile(r"\b\d+\.x\b"),  # 4.x
    re.compile(r"(?<![\d,.])(?:199\d|20[0-2]\d|2030)(?![\d,]|\.\d)"),  # years
    re.compile(r"(?<![\w.,])(?:10|[0-9])(?![\w]|[.,]\d|\s*%)"),  # counts and constants, 0 to 10
]
PROSE_NUMBER = re.compile(
    r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w]|[.,]\d)"
)
PRINTED_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
GROUPED_NUMBER = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d])")


def canonical(number: str) -> str:
    """`1,024` -> `1024`; scientific notation written out: `3.3e-01` -> `0.33`."""
    number = number.replace(",", "")
    if "e" in number.lower():
        return format(Decimal(number), "f")
    return number


def is_ignored(cell) -> bool:
    tags = set(cell.get("metadata", {}).get("tags", []))
    return bool(tags & IGNORED_TAGS or IGNORED.search(cell_source(cell)))


def sanitizers():
    """(pattern, replacement) of tests/nbval-sanitize.cfg: what nbval masks is not compared."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(SANITIZE)
    sections = [config[name] for name in config.sections()]
    return [(re.compile(section["regex"]), section["replace"]) for section in sections]


def printed_text(cell):
    """The text a cell's outputs print, as nbval compares it: with the sanitizer's masks."""
    for text in _raw_printed_text(cell):
        for pattern, replacement in SANITIZERS:
            text = pattern.sub(replacement, text)
        yield text


SANITIZERS = sanitizers()


def _raw_printed_text(cell):
    for output in cell.get("outputs", []):
        if "text" in output:
            yield cell_source({"source": output["text"]})
        for mime, value in output.get("data", {}).items():
            if mime.startswith("text/"):
                yield cell_source({"source": value})


# What a folded answer's code prints, stored beside it as a ```text block; tests/test_answers.py
# runs that code and compares its output with the block exactly.
ANSWER_OUTPUT = (
    re.compile(r"<details><summary>Answer</summary>\n.*?\n</details>", re.S),
    re.compile(r"^```text\n(.*?)^```$", re.S | re.M),
)


def printed_numbers(cells) -> set:
    """Every number the compared outputs of these cells print, in canonical form.

    The outputs that a folded answer shows in its ```text blocks count too (see ANSWER_OUTPUT).
    """
    found = set()
    details, text_block = ANSWER_OUTPUT
    for cell in cells:
        if cell["cell_type"] == "markdown":
            for answer in details.findall(cell_source(cell)):
                for text in text_block.findall(answer):
                    found.update(canonical(n) for n in PRINTED_NUMBER.findall(text))
                    found.update(canonical(n) for n in GROUPED_NUMBER.findall(text))
            continue
        if cell["cell_type"] != "code" or cell.get("execution_count") is None or is_ignored(cell):
            continue
        for text in printed_text(cell):
            found.update(canonical(n) for n in PRINTED_NUMBER.findall(text))
            found.update(canonical(n) for n in GROUPED_NUMBER.findall(text))
    return found


def prose_numbers(markdown: str):
    """(number as written, given?, context) for every non-exempt number in the prose."""
    for block in prose_blocks(markdown):
        text = re.sub(r"\bx(?=\d)|(?<=\d)x\b|×", " ", block).replace("..", " .. ")
        for pattern in EXEMPT:
            text = pattern.sub(" ", text)
        given_spans = [m.span() for m in re.finditer(f"{GIVEN_OPEN}[^{GIVEN_CLOSE}]*", text)]
        for match in PROSE_NUMBER.finditer(text):
            given = any(a <= match.start() < b for a, b in given_spans)
            start = max(match.start() - 40, 0)
            context = re.sub(r"[\x00-\x03]", "_", text[start : match.end() + 25])
            yield match.group(0), given, " ".join(context.split())


def unprinted_numbers(cells) -> list:
    """(cell index, number, context) for every prose number no compared output prints."""
    printed = printed_numbers(cells)
    missing = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        for number, given, context in prose_numbers(cell_source(cell)):
            if not given and canonical(number) not in printed:
                missing.append((index, number, context))
    return missing


def given_numbers(cells) -> list:
    return [
        (index, number, context)
        for index, cell in enumerate(cells)
        if cell["cell_type"] == "markdown"
        for number, given, context in prose_numbers(cell_source(cell))
        if given
    ]


def notebook_id(path):
    return path.stem


@pytest.mark.parametrize("path", notebooks(), ids=notebook_id)
def test_every_number_in_the_prose_is_printed(path):
    missing = unprinted_numbers(notebook_cells(path))
    report = "\n".join(f"  cell {i}: {n!r} in '...{c}...'" for i, n, c in missing)
    assert not missing, (
        f"{len(missing)} number(s) in the prose of {path.name} are printed by no compared cell "
        f"at that precision. Print them, quote what is printed, or, for a number that is given "
        f'rather than measured, write <span class="given">N</span>:\n{report}'
    )


def test_given_numbers_stay_few():
    found = {path.name: given_numbers(notebook_cells(path)) for path in notebooks()}
    total = sum(len(numbers) for numbers in found.values())
    print(f"\n{total} number(s) in the notebooks' prose are marked as given:")
    for name, numbers in found.items():
        for index, number, context in numbers:
            print(f"  {name} cell {index}: {number} in '...{context}...'")
    assert total <= MAX_GIVEN, f"{total} given numbers: measure some of them instead"


# The check itself, on planted notebooks.


def planted(markdown: str, code: str, output: str, ignored: bool = False):
    source = ("# NBVAL_IGNORE_OUTPUT\n# Reason: machine-dependent.\n" if ignored else "") + code
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=output)]
    notebook = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell(markdown)])
    nbformat.validate(notebook)
    return notebook["cells"]


def flagged(markdown, output, ignored=False):
    return [n for _, n, _ in unprinted_numbers(planted(markdown, "print(...)", output, ignored))]


def test_the_check_catches_the_issues_examples():
    output = "this machine: 23.5 GiB\nratio 1.007 0.996 1.013\n  64   0.995\n"
    assert flagged("Fix $M = 24$ GiB, this machine's size.", output) == ["24"]
    assert flagged("Fix $M = 23.5$ GiB, this machine's size.", output) == []
    assert flagged("The ratio stays within 1.5 % of 1.", output) == ["1.5"]
    assert flagged("The ratio stays within 1.3 % of 1.", "ratio 1.3 %\n") == []
    assert flagged("At d = 64 the weight is 0.99.", output) == ["0.99"]
    assert flagged("At d = 64 the weight is 0.995.", output) == []


def test_precision_is_as_written():
    output = "norm 3.3e-01, 0.330 and 16,384 tokens, 2.38e-03\n"
    assert flagged("From 0.33 to 16,384 and 16384.", output) == []
    assert flagged("From 0.3 and 0.3300.", output) == ["0.3", "0.3300"]
    assert flagged("A gap of 2.38e-3.", output) == []
    assert flagged("It saves 12x, or x12, or 13x.", "saving: 12x\n") == ["13"]


def test_outputs_nbval_ignores_do_not_count():
    assert flagged("It holds 291.0 MiB.", "T = 512: 291.0 MiB\n", ignored=True) == ["291.0"]
    assert flagged("It holds 291.0 MiB.", "T = 512: 291.0 MiB\n") == []


def test_numbers_the_sanitizer_masks_do_not_count():
    """Durations and rounding-size numbers differ by machine: nbval masks them, so does this."""
    assert flagged("It took 291.0 ms.", "T = 512: 291.0 ms\n") == ["291.0"]
    assert flagged("A gap of 2.4e-07 here.", "gap 2.4e-07\n") == ["2.4e-07"]
    assert flagged("A gap of 2.4e-3.", "gap 2.4e-03\n") == []


def test_exemptions():
    prose = (
        "As chapter 13 shows (chapters 3 and 4, section 2.1, §20.2-20.3, pp. 50-91), eq. (2.2) "
        "and eqs. (6.1)-(6.2), equation 1.8 and (8.4) hold. torch 2.5, Python 3.11, version "
        "2.13.0, transformers 4.x and >= 4.51 are versions; Vaswani et al., 2017. "
        "Math $d = \\sqrt{97}$, code `T = 99`, [a link](https://example.org/page-77), "
        "<https://example.org/88>, "
        "float32 and Qwen3-0.6B are not prose numbers. Step 1 and exercise 4 are labels."
    )
    assert flagged(prose, "nothing\n") == []


def test_given_numbers_are_exempt_and_counted():
    cells = planted('It was <span class="given">1.5</span> % and 7.25.', "print()", "x\n")
    assert [n for _, n, _ in unprinted_numbers(cells)] == ["7.25"]
    assert [n for _, n, _ in given_numbers(cells)] == ["1.5"]


def test_the_given_marker_is_invisible():
    """Both renderers pass the span through as HTML: the reader sees only the number."""
    from docutils.core import publish_string
    from markdown_it import MarkdownIt
    from myst_parser.parsers.docutils_ import Parser

    source = 'The draft says <span class="given">0.139</span> here.\n'
    expected = '<p>The draft says <span class="given">0.139</span> here.</p>'
    assert MarkdownIt("commonmark").render(source).strip() == expected  # as Jupyter's renderer
    html = publish_string(source, parser=Parser(), writer_name="html5").decode()
    assert expected in html  # as MyST (myst-nb) renders it into the book
    visible = re.sub(r"<[^>]+>", "", expected)
    assert visible == "The draft says 0.139 here."
