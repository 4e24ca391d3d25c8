"""The book says things in its own words: no run of 12 words is shared with the seed drafts.

The seeds are the two early drafts the book grew from, kept beside the repository in
`../shared/seeds/*.txt`. Facts, figures and the two example sentences may carry over; sentences
may not. Every Markdown cell of every notebook and every `book/*.md` page is compared with them.

How the text is compared. Math (`$...$`, `$$...$$`, `\\begin{...}`), code blocks, link targets,
URLs and raw HTML are dropped from the Markdown (tests/markdown_prose.py), and math from the
seeds; inline code keeps its words. Both are lower-cased, apostrophes are dropped ("didn't" is
one word), every other character that is not a letter, a digit or `_` separates words, and
words made only of digits are dropped. The two
example sentences, "Your journey starts with one step" and "The animal didn't cross the street
because it was too tired", are cut out of both, and no run may cross a cut, a paragraph or a
block. What remains may not share a run of RUN (12) consecutive words with any seed.

Where the seeds are absent (a reader's clone without `../shared/seeds`), the test is skipped;
ATTNLIB_SEEDS names another folder of seeds, for a clone that lives elsewhere.
"""

import os
import re
from pathlib import Path

import nbformat
import pytest

from tests.markdown_prose import (
    CODE,
    MATH,
    ROOT,
    book_pages,
    cell_source,
    notebook_cells,
    notebooks,
    prose_blocks,
)

RUN = 8
SEEDS = Path(os.environ.get("ATTNLIB_SEEDS", ROOT.parent / "shared" / "seeds"))
EXAMPLES = [
    "your journey starts with one step",
    "the animal didnt cross the street because it was too tired",
]
BREAK = "|"


def normalise(text: str) -> str:
    """Lower-case words separated by single spaces; BREAK where a run may not continue."""
    text = text.lower().replace("\u2019", "'").replace("\u2018", "'").replace("'", "")
    text = text.replace(MATH, " ").replace(CODE, f" {BREAK} ")
    text = re.sub(r"[^\w|]+", " ", text)
    return " ".join(w for w in text.split() if not w.isdigit())


def words(text: str) -> list:
    """The words of a text, with the example sentences cut out."""
    text = normalise(text)
    for sentence in EXAMPLES:
        text = text.replace(sentence, f" {BREAK} ")
    return text.split()


def segments(tokens: list) -> list:
    """The stretches of words between BREAKs."""
    return [part.split() for part in " ".join(tokens).split(BREAK)]


def runs(tokens: list, length: int = RUN):
    """The tuples of `length` consecutive words that do not cross a BREAK."""
    for segment in segments(tokens):
        for i in range(len(segment) - length + 1):
            yield tuple(segment[i : i + length])


def strip_math(text: str) -> str:
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    return re.sub(r"\$[^$\n]*\$", " ", text)


def seed_runs(texts) -> set:
    found = set()
    for text in texts:
        for line in strip_math(text).splitlines():
            found.update(runs(words(line)))
    return found


def shared_passages(markdown: str, seeds: set) -> list:
    """The longest runs of words that a Markdown text shares with the seeds."""
    passages = []
    for block in prose_blocks(markdown, code_text=True):
        for segment in segments(words(block)):
            start = end = None  # the current passage is segment[start:end]
            for i in range(len(segment) - RUN + 1):
                if tuple(segment[i : i + RUN]) not in seeds:
                    continue
                if start is not None and i <= end:
                    end = i + RUN
                    continue
                if start is not None:
                    passages.append(" ".join(segment[start:end]))
                start, end = i, i + RUN
            if start is not None:
                passages.append(" ".join(segment[start:end]))
    return passages


@pytest.fixture(scope="module")
def seeds():
    files = sorted(SEEDS.glob("*.txt")) if SEEDS.is_dir() else []
    if not files:
        pytest.skip(f"no seed drafts at {SEEDS} (a reader's clone): nothing to compare with")
    return seed_runs(path.read_text(encoding="utf-8") for path in files)


def notebook_id(path):
    return path.stem


@pytest.mark.parametrize("path", notebooks(), ids=notebook_id)
def test_notebook_is_in_its_own_words(path, seeds):
    found = [
        (index, passage)
        for index, cell in enumerate(notebook_cells(path))
        if cell["cell_type"] == "markdown"
        for passage in shared_passages(cell_source(cell), seeds)
    ]
    report = "\n".join(f"  cell {i}: '{p}'" for i, p in found)
    assert not found, f"{path.name} shares runs of {RUN}+ words with the seeds:\n{report}"


@pytest.mark.parametrize("path", book_pages(), ids=lambda path: path.name)
def test_book_page_is_in_its_own_words(path, seeds):
    found = shared_passages(path.read_text(encoding="utf-8"), seeds)
    report = "\n".join(f"  '{p}'" for p in found)
    assert not found, f"{path.name} shares runs of {RUN}+ words with the seeds:\n{report}"


# The check itself, on planted text.

PLANTED_SEED = (
    "Separating keys from values is the important design choice. A token can be found for one "
    "reason and contribute something else. For “it”, the query might look for $x_i W_q$ an "
    "“animate noun earlier in the sentence”.\n"
    "Six tokens, “Your journey starts with one step”, each already embedded as a "
    "3-dimensional vector, as in “The animal didn’t cross the street because it was too tired”."
)


def test_the_check_catches_a_copied_sentence_in_a_notebook():
    seeds = seed_runs([PLANTED_SEED])
    copied = "Keys and values differ. A token can be *found* for one reason and contribute "
    copied += "something else."
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(copied)])
    nbformat.validate(notebook)
    found = [p for cell in notebook["cells"] for p in shared_passages(cell_source(cell), seeds)]
    assert found == ["a token can be found for one reason and contribute something else"]


def test_case_punctuation_math_and_numbers_do_not_hide_a_copy():
    seeds = seed_runs([PLANTED_SEED])
    copied = (
        "FOR 'IT', THE QUERY MIGHT LOOK FOR $q = x W_Q$ AN ANIMATE NOUN EARLIER IN THE SENTENCE!"
    )
    assert shared_passages(copied, seeds) == [
        "for it the query might look for an animate noun earlier in the sentence"
    ]


def test_the_two_example_sentences_and_short_runs_are_allowed():
    seeds = seed_runs([PLANTED_SEED])
    own = (
        'Take the six tokens of "Your journey starts with one step", each a 3-dimensional '
        'vector, and "The animal didn\'t cross the street because it was too tired" too. '
        "A token may be found for one reason and contribute something else entirely."
    )
    assert shared_passages(own, seeds) == []


def test_the_seeds_hold_the_two_example_sentences():
    if not SEEDS.is_dir():
        pytest.skip(f"no seed drafts at {SEEDS} (a reader's clone): nothing to compare with")
    text = " ".join(normalise(path.read_text(encoding="utf-8")) for path in SEEDS.glob("*.txt"))
    for sentence in EXAMPLES:
        assert sentence in text, f"no seed holds {sentence!r} any more: update EXAMPLES"
