"""The running prose of the book's Markdown, as the two prose checks read it.

`prose_blocks(markdown)` parses MyST Markdown with markdown-it (the parser under myst-nb) and
returns one plain string per paragraph, heading, list item or table cell. What is not prose is
replaced by a separator, `MATH` for math and `CODE` for code, so that no number or word run
crosses it:

* math: `$...$`, `$$...$$` and `\\begin{...}...\\end{...}` blocks, except that inline math
  which only states a value (`$M = 24$`, `$T = 8{,}192$`) leaves its number in the prose;
* code: inline code spans and fenced or indented code blocks;
* link targets and autolinks (`<https://...>`), bare URLs and raw HTML.

The contents of MyST directives (```` ```{warning} ````, `:::{dropdown}`, `:::{note}`, grids) are
prose and are parsed in turn; code-like directives (`code-cell`, `math`, `raw`, ...) are not.

A number that is given rather than measured is wrapped as `<span class="given">...</span>`. Both
renderers the book meets pass the span through as HTML, so the reader sees only the number. In the
returned strings the span's contents sit between `GIVEN_OPEN` and `GIVEN_CLOSE`.
"""

import json
import re
from pathlib import Path

from markdown_it import MarkdownIt
from mdit_py_plugins.amsmath import amsmath_plugin
from mdit_py_plugins.colon_fence import colon_fence_plugin
from mdit_py_plugins.dollarmath import dollarmath_plugin

ROOT = Path(__file__).resolve().parent.parent
MATH, CODE = "\x00", "\x03"
GIVEN_OPEN, GIVEN_CLOSE = "\x01", "\x02"
GIVEN_TAG = re.compile(r'<span\s+class="given"\s*>', re.I)
# Directives whose body is not Markdown prose.
LITERAL_DIRECTIVES = {
    "code",
    "code-block",
    "code-cell",
    "sourcecode",
    "math",
    "raw",
    "eval-rst",
    "literalinclude",
    "glue",
    "mermaid",
}
# Inline math that only states a value, such as `$M = 24$` or `$T = 8{,}192$`: its number is
# prose written in math, and is returned.
SIMPLE_VALUE = re.compile(
    r"^[^=<>]*?(?:=|\\approx)\s*((?:\d{1,3}(?:\{,\}\d{3})+|\d+)(?:\.\d+)?)\s*"
    r"(?:\\[,;:! ]\s*)?(?:\\(?:text|mathrm)\{\s*[A-Za-z/ ]+\})?\s*$"
)
URL = re.compile(r"\b(?:https?|file)://\S+")
OPTION = re.compile(r"^:[\w-]+:.*$")

_parser = (
    MarkdownIt("commonmark", {"html": True})
    .enable("table")
    .use(dollarmath_plugin, double_inline=True)
    .use(amsmath_plugin)
    .use(colon_fence_plugin)
)


def _inline_text(token, code_text: bool) -> str:
    """One inline token's plain text: math and code become separators, given spans marked."""
    parts, in_autolink, given_depth = [], False, 0
    for child in token.children or []:
        kind = child.type
        if kind == "link_open" and child.markup == "autolink":
            in_autolink = True
        elif kind == "link_close" and in_autolink:
            in_autolink = False
        elif in_autolink:
            continue
        elif kind == "text":
            parts.append(child.content)
        elif kind in ("softbreak", "hardbreak"):
            parts.append(" ")
        elif kind == "code_inline":
            parts.append(f" {child.content} " if code_text else f" {CODE} ")
        elif kind.startswith("math"):
            value = SIMPLE_VALUE.match(child.content)
            parts.append(f" {MATH} {value.group(1).replace('{,}', ',')} " if value else f" {MATH} ")
        elif kind == "html_inline":
            if GIVEN_TAG.fullmatch(child.content.strip()):
                given_depth += 1
                parts.append(GIVEN_OPEN)
            elif child.content.strip().lower() == "</span>" and given_depth:
                given_depth -= 1
                parts.append(GIVEN_CLOSE)
            else:
                parts.append(" ")
    return URL.sub(" ", "".join(parts))


TARGET = re.compile(r"^\([\w-]+\)=[ \t]*$", re.M)


def _directive(info: str):
    """`{name} argument` of a MyST directive fence, or None for a plain fence."""
    match = re.match(r"\{([\w:-]+)\}\s*(.*)", info.strip())
    return (match.group(1), match.group(2)) if match else None


def prose_blocks(markdown: str, code_text: bool = False, quotes: bool = True) -> list:
    """The prose of a Markdown text, one string per block (see the module's docstring).

    With code_text, inline code spans keep their text (they are words of a sentence). With
    quotes=False, blockquotes (`> ...`) are left out.
    """
    blocks, quoted = [], 0
    markdown = TARGET.sub("", markdown)  # MyST targets such as "(exercise-5-1)=" are not prose
    for token in _parser.parse(markdown):
        if token.type in ("blockquote_open", "blockquote_close"):
            quoted += 1 if token.type == "blockquote_open" else -1
            blocks.append(CODE)
        elif quoted and not quotes:
            continue
        elif token.type == "inline":
            blocks.append(_inline_text(token, code_text))
        elif token.type in ("fence", "colon_fence"):
            directive = _directive(token.info)
            if directive and directive[0] not in LITERAL_DIRECTIVES:
                name, argument = directive
                if argument:
                    blocks.extend(prose_blocks(argument, code_text, quotes))
                body = token.content.splitlines()
                while body and OPTION.match(body[0].strip()):
                    body.pop(0)  # directive options such as ":class: note"
                blocks.extend(prose_blocks("\n".join(body), code_text, quotes))
            else:
                blocks.append(CODE)
    return blocks


def cell_source(cell) -> str:
    text = cell["source"]
    return text if isinstance(text, str) else "".join(text)


def notebook_cells(path) -> list:
    return json.loads(Path(path).read_text(encoding="utf-8"))["cells"]


def notebooks() -> list:
    return sorted((ROOT / "notebooks").glob("*.ipynb"))


def book_pages() -> list:
    return sorted((ROOT / "book").glob("*.md"))
