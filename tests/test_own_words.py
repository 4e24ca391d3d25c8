"""The book says things in its own words: no run of 8 words is shared with the source chapters.

The source chapters the book grew from are kept beside the repository in `../shared/seeds/*.txt`.
Facts, figures and the two example sentences may carry over; sentences may not. Every Markdown
cell of every notebook and every `book/*.md` page is compared with them.

How the text is compared. Math (`$...$`, `$$...$$`, `\\begin{...}`), code (inline and blocks),
link targets, URLs and raw HTML are dropped from the Markdown (tests/markdown_prose.py), and math
from the seeds. Exempt too, as quotations or names rather than the book's sentences: blockquotes
(`> ...`), text in quote marks (“...” or "..."), dotted API names written out
(torch.nn.functional.scaled_dot_product_attention) and, in book/references.md, the italic titles
of the works cited. Both texts are lower-cased, apostrophes are dropped ("didn't" is one word),
every other character that is not a letter, a digit or `_` separates words, and words made only
of digits are dropped. The two example sentences, "Your journey starts with one step" and "The
animal didn't cross the street because it was too tired", are cut out of both, and no run may
cross a cut, a paragraph or a block. What remains may not share a run of RUN (8) consecutive
words with any seed.

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
QUOTED = re.compile(r"“[^”]*”|\"[^\"\n]*\"")  # an inline quotation, in curly or straight marks
API_NAME = re.compile(r"\b\w+(?:\.\w+)+\b")  # torch.nn.functional.scaled_dot_product_attention
TITLE = re.compile(r"(?<![*\w])\*(?=\S)[^*]+?\*(?![*\w])", re.S)  # *Attention Is All You Need.*


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


def own_text(block: str) -> str:
    """A block of prose less its quotations and API names, each left as a BREAK."""
    block = block.replace("\u201c", "“").replace("\u201d", "”")
    return API_NAME.sub(f" {BREAK} ", QUOTED.sub(f" {BREAK} ", block))


def shared_passages(markdown: str, seeds: set, titles: bool = False) -> list:
    """The longest runs of words that a Markdown text shares with the seeds.

    With titles, italic spans are the titles of cited works and are left out (references.md).
    """
    if titles:
        markdown = TITLE.sub(" `title` ", markdown)
    passages = []
    for block in prose_blocks(markdown, quotes=False):
        for segment in segments(words(own_text(block))):
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
    found = shared_passages(path.read_text(encoding="utf-8"), seeds, path.name == "references.md")
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
        "A token may be found for one reason, and give something else entirely."
    )
    assert shared_passages(own, seeds) == []


def test_a_shared_run_of_eight_words_is_caught_and_one_of_seven_is_not():
    seeds = seed_runs([PLANTED_SEED])
    eight = "Here a token can be found for one reason and then it adds a different thing."
    assert shared_passages(eight, seeds) == ["a token can be found for one reason and"]
    seven = "Here one token can be found for one reason, then adds a different thing."
    assert shared_passages(seven, seeds) == []


COPIED = "a token can be found for one reason and contribute something else"


def test_marked_quotations_inline_code_and_api_names_are_exempt():
    seeds = seed_runs([PLANTED_SEED + " use torch.nn.functional.scaled_dot_product_attention"])
    assert shared_passages(f"The source says:\n\n> {COPIED.capitalize()}.\n", seeds) == []
    assert shared_passages(f"The source says “{COPIED}”, and so do we.", seeds) == []
    assert shared_passages(f'The source says "{COPIED}", and so do we.', seeds) == []
    assert shared_passages(f"Its comment reads `{COPIED}`.", seeds) == []
    api = "Separating keys from values is the important design choice"
    assert shared_passages(f"{api}, so torch.nn.functional.scaled_dot_product_attention", seeds)
    assert not shared_passages(
        "We use torch.nn.functional.scaled_dot_product_attention for it", seeds
    )
    # The same words outside the marks are still caught.
    assert shared_passages(f"As we say, {COPIED}.", seeds) == [COPIED]


def test_titles_are_exempt_only_in_the_references():
    seeds = seed_runs(["The book is called Separating keys from values is the important design."])
    entry = "- A. Author (2020). *Separating Keys from Values is the Important Design.* A journal."
    assert shared_passages(entry, seeds, titles=True) == []
    assert shared_passages(entry, seeds) == ["separating keys from values is the important design"]


def test_the_seeds_hold_the_two_example_sentences():
    if not SEEDS.is_dir():
        pytest.skip(f"no seed drafts at {SEEDS} (a reader's clone): nothing to compare with")
    text = " ".join(normalise(path.read_text(encoding="utf-8")) for path in SEEDS.glob("*.txt"))
    for sentence in EXAMPLES:
        assert sentence in text, f"no seed holds {sentence!r} any more: update EXAMPLES"
