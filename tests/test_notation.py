"""One letter, one meaning: book/notation.md's tables agree with the math of the chapters.

The notation page has two tables whose rows read `| symbols | meaning | chapters |`: "Symbols"
(letters) and "Functions" (the book's operator names, `\\operatorname{...}`). The tests read
every `$...$` and `$$...$$` of every chapter's markdown cells and of book/*.md with the
parser the book is built with (MyST's, with the extensions of `_config.yml`), pull the symbols
out of each formula and check that

* (a) every symbol and operator name the book's math uses has a row;
* (b) each row's chapter list is exactly the chapters whose math uses one of its symbols
  (book pages are not chapters: a symbol used only there lists none, `—`);
* (c) none of the FORBIDDEN symbols or spellings appears (retired letters, `P` as weights,
  `\\Theta(...)` as a bound, `K^T` for a transpose, ...);
* and that a symbol has one row, and the formulas use no LaTeX command the extraction does
  not know (so that a new letter cannot slip past it).

How a formula becomes symbols (`symbols()`):

* A symbol is a Latin letter, a Greek letter (`\\alpha` ... `\\Omega`, `\\ell`), a letter or
  digit in a font (`\\mathcal{L}`, `\\mathbb{E}`, `\\mathbf{1}`, `\\mathrm{d}`) or under an
  accent (`\\bar q`, `\\tilde o`). Runs of letters are one symbol per letter (`QK` is `Q`, `K`).
* A subscript is part of the name when it is a label: a word (`d_\\text{model}`), capitals
  (`W_Q`, `W_{OV}`), or a name in COMPOSITES (`d_k`, `H_{kv}`, `\\gamma^q`). Any other script
  is an index or an exponent: it is read as a formula of its own (`z_{ij}` is `z`, `i`, `j`).
* Not symbols: digits, operators and relations (`\\sum`, `\\log`, `\\max`, `\\top`, ...),
  words in `\\text{...}` and the like (`\\text{FLOPs}` is a named quantity, written out), the
  book's operator names (`\\operatorname{softmax}`: counted separately, as functions), primes.
"""

import json
import re
from functools import cache
from pathlib import Path

import yaml
from markdown_it.renderer import RendererHTML
from myst_parser.config.main import MdParserConfig
from myst_parser.parsers.mdit import create_md_parser

ROOT = Path(__file__).resolve().parent.parent
# MyST's own parser, with the extensions the book is built with: a formula MyST does not see
# (a `$$` glued to the line before it in a list item) is not math here either.
EXTENSIONS = yaml.safe_load((ROOT / "_config.yml").read_text())["parse"]["myst_enable_extensions"]
_parser = create_md_parser(MdParserConfig(enable_extensions=set(EXTENSIONS)), RendererHTML)
NOTATION = ROOT / "book" / "notation.md"

GREEK = set(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu "
    "xi pi varpi rho varrho sigma varsigma tau upsilon phi varphi chi psi omega "
    "Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega ell".split()
)
FONTS = {"mathcal", "mathbb", "mathbf", "mathrm", "mathit", "boldsymbol", "mathsf", "mathscr"}
WORDS = {"text", "textrm", "texttt", "textit", "textbf", "mbox"}
OPERATOR_NAMES = {"operatorname", "operatorname*"}
DROPPED = {"tag", "label", "begin", "end", "hspace", "color"}  # with their argument
ACCENTS = {"hat", "bar", "tilde", "vec", "dot", "overline", "widehat", "widetilde"}
# Commands that are not symbols: standard functions, big operators, relations, arrows,
# delimiters, spacing and layout.
OPERATORS = set(
    """log ln exp sin cos tan tanh max min sup inf arg det lim Pr sum prod int frac dfrac tfrac
    sqrt left right big Big bigl bigr Bigl Bigr bigg Bigg biggl biggr middle quad qquad cdot
    cdots ldots dots vdots ddots times div pm mp odot otimes oplus circ le leq ge geq ne neq
    approx sim simeq equiv propto to rightarrow leftarrow Rightarrow iff implies in notin subset
    subseteq cup cap setminus infty partial nabla top bmod mod pmod lfloor rfloor lceil rceil
    langle rangle lvert rvert lVert rVert Vert vert mid underbrace overbrace textstyle
    displaystyle scriptstyle triangle cr mapsto forall exists neg land lor ast star emptyset
    prime colon""".split()
)
# Label subscripts and superscripts in lower case: without this list they would read as an
# index (`d_k` as `d` and `k`).
COMPOSITES = {
    "d_k",
    "d_v",
    "D_v",
    "H_q",
    "H_{kv}",
    "\\gamma^q",
    "\\gamma^k",
    "R^{\\text{half}}",
    "R^{\\text{pairs}}",
}
# Symbols that must not appear, and spellings that must not, with what to write instead.
FORBIDDEN_SYMBOLS = {
    "L": "L is retired: T or S for a length, \\mathcal{L} the loss, \\operatorname{lse}",
    "b": "b is retired: \\Theta the RoPE base, \\nu bytes per number",
}
FORBIDDEN_SPELLINGS = {
    r"(?<![\\A-Za-z])P_\{?i[jk]|\\mathrm\{d\}\s*P\b": "the weights are A, not P",
    r"\\Theta\s*(?:\\[!,]\s*)*(?:\\left|\\big\w*)?\s*\(": "an order is \\mathcal{O}(...)",
    r"(?<![\\A-Za-z])O\s*(?:\\left|\\big\w*)?\s*\(": "an order is \\mathcal{O}(...), O the output",
    r"(?<!\\mathbb\{R\})\^\s*(?:T|\{\s*T\s*\})(?![A-Za-z_{])": "a transpose is ^\\top",
    r"\\delta_\{?[a-z]\s*,?\s*[a-z]": "Kronecker's delta is \\mathbb{1}_{i=j}",
    r"(?<![\\A-Za-z])d(?=[A-Z])": "a gradient is \\mathrm{d}X, not the width d times X",
}

TOKEN = re.compile(r"\\([A-Za-z]+\*?)|\\(.)|([A-Za-z])|([0-9])|([_^{}'])|(\s+)|(.)", re.S)


def tokens(latex: str) -> list:
    """The formula as (kind, text): cmd, esc, letter, digit, other, or `_ ^ { } '` itself."""
    out = []
    kinds = ("cmd", "esc", "letter", "digit", None, None, "other")
    for match in TOKEN.finditer(latex):
        groups = match.groups()
        if groups[5] is None:  # not a space
            index = next(k for k, text in enumerate(groups) if text is not None)
            out.append((kinds[index] or groups[index], groups[index]))
    return out


def _argument(toks, i):
    """The argument at toks[i], a braced group's tokens or one token, and the index after it."""
    if i >= len(toks):
        return [], i
    if toks[i][0] == "{":
        depth, j = 1, i + 1
        while j < len(toks) and depth:
            depth += {"{": 1, "}": -1}.get(toks[j][0], 0)
            j += 1
        return toks[i + 1 : j - 1], j
    if toks[i][0] == "cmd" and toks[i][1] in WORDS | FONTS | OPERATOR_NAMES:
        arg, j = _argument(toks, i + 1)
        return [toks[i], ("{", "{"), *arg, ("}", "}")], j
    return [toks[i]], i + 1


def _plain(toks) -> str:
    return "".join("\\" + t if k == "cmd" else t for k, t in toks if k not in "{}")


class _Reader:
    """One formula's symbols, operator names and unknown commands (see the docstring)."""

    def __init__(self, composites, table):
        self.composites, self.table = composites, table
        self.symbols, self.operators, self.unknown = [], [], []

    def formula(self, toks):
        i = 0
        while i < len(toks):
            kind, text = toks[i]
            if kind == "letter":
                i = self._scripts(text, toks, i + 1)
            elif kind == "cmd" and text in GREEK:
                i = self._scripts("\\" + text, toks, i + 1)
            elif kind == "cmd" and text in FONTS:
                arg, i = _argument(toks, i + 1)
                if len(arg) == 1 and arg[0][0] in ("letter", "digit"):
                    i = self._scripts(f"\\{text}{{{arg[0][1]}}}", toks, i)
                elif text != "mathrm":  # a word set upright is not a symbol
                    self.formula(arg)
            elif kind == "cmd" and text in ACCENTS:
                arg, i = _argument(toks, i + 1)
                if len(arg) == 1 and (arg[0][0] == "letter" or arg[0][1] in GREEK):
                    name = arg[0][1] if arg[0][0] == "letter" else "\\" + arg[0][1]
                    i = self._scripts(f"\\{text}{{{name}}}", toks, i)
                else:  # an accent over a whole expression is an operator
                    self.formula(arg)
            elif kind == "cmd" and text in OPERATOR_NAMES:
                arg, i = _argument(toks, i + 1)
                self.operators.append(_plain(arg).replace("\\_", "_").strip())
            elif kind == "cmd" and text in WORDS | DROPPED:
                _, i = _argument(toks, i + 1)
            elif kind == "cmd":
                if text not in OPERATORS:
                    self.unknown.append("\\" + text)
                i += 1
            elif kind in ("_", "^", "{"):  # a script on no symbol (\sum_j, (x)^2), a group
                arg, i = _argument(toks, i + (kind != "{"))
                self.formula(arg)
            else:
                i += 1

    @staticmethod
    def _label(arg):
        """The label a script spells (`Q`, `kv`, `\\text{model}`), or None."""
        if len(arg) >= 3 and arg[0][0] == "cmd" and arg[0][1] in WORDS | {"mathrm"}:
            word, end = _argument(arg, 1)
            return "\\text{" + _plain(word).strip() + "}" if end == len(arg) else None
        if arg and all(kind == "letter" for kind, _ in arg):
            return "".join(text for _, text in arg)
        return None

    def _scripts(self, name, toks, i):
        while i < len(toks) and toks[i][0] in ("_", "^", "'"):
            mark = toks[i][0]
            if mark == "'":
                i += 1
                continue
            arg, i = _argument(toks, i + 1)
            label = self._label(arg)
            if label is not None:
                joined = f"{name}{mark}{label if len(label) == 1 else '{' + label + '}'}"
                is_label = label.startswith("\\text") or label.isupper()
                if self.table or joined in self.composites or mark == "_" and is_label:
                    name = joined
                    continue
            self.formula(arg)
        self.symbols.append(name)
        return i


def read(latex: str, composites=COMPOSITES, table=False) -> _Reader:
    """A formula's symbols, operator names and unknown commands. With table=True every label
    script is part of the name: a table cell spells its symbols whole (`$H_q$`, `$g^q$`)."""
    reader = _Reader(composites, table)
    reader.formula(tokens(latex))
    return reader


def symbols(latex: str) -> list:
    return read(latex).symbols


def math_of(markdown: str) -> list:
    """The formulas of a Markdown text, in order, as MyST parses them."""
    found = []

    def walk(stream):
        for token in stream:
            if token.type.startswith("math") or token.type == "amsmath":
                found.append(token.content)
            walk(token.children or [])

    walk(_parser.parse(markdown))
    return found


def chapter_number(path: Path) -> int:
    return int(path.stem.split("_")[0])


@cache
def book_markdown() -> dict:
    """{chapter number or page name: its markdown}: the chapters' markdown cells, book/*.md."""
    pages = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        pages[chapter_number(path)] = "\n\n".join(sources)
    for path in sorted((ROOT / "book").glob("*.md")):
        pages[path.stem] = path.read_text(encoding="utf-8")
    return pages


# A table row: `| $a$, $A_{ij}$ | meaning | 1-5, 14 |`; the section's heading names the table.
ROW = re.compile(r"^\|(?P<cells>.*)\|\s*$")


def table(markdown: str, heading: str) -> list:
    """The rows of the table under `## heading`: (symbols cell, meaning, chapters cell)."""
    section = re.search(rf"^## {heading}\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert section, f"notation.md has no '## {heading}' section"
    rows = []
    for line in section.group(1).splitlines():
        match = ROW.match(line.strip())
        if match:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", match.group("cells"))]
            if len(cells) == 3 and not set(cells[0]) <= set("-: ") and cells[1] != "meaning":
                rows.append(tuple(cells))
    return rows


def chapter_list(cell: str) -> set:
    """'1-5, 8, 12' -> {1, 2, 3, 4, 5, 8, 12}; '—' -> set()."""
    found = set()
    for part in re.split(r",\s*", cell.strip()):
        if part in ("—", "-", ""):
            continue
        ends = re.fullmatch(r"(\d+)\s*[-–]\s*(\d+)|(\d+)", part)
        assert ends, f"a chapter list reads like '1-5, 8': {cell!r}"
        first, last, single = ends.groups()
        found |= set(range(int(first), int(last) + 1)) if first else {int(single)}
    return found


def declared(rows: list, functions: bool = False) -> list:
    """(names, meaning, chapters) for each row: a symbol row's formulas read in table mode."""
    out = []
    for names_cell, meaning, chapters in rows:
        names = []
        for latex in math_of(names_cell):
            reader = read(latex, table=True)
            names += reader.operators if functions else reader.symbols
        out.append((names, meaning, chapter_list(chapters)))
    return out


def usage(pages: dict, composites=COMPOSITES) -> tuple:
    """({symbol: {page keys}}, {operator: {page keys}}, {unknown command: {page keys}})."""
    used, operators, unknown = {}, {}, {}
    for key, markdown in pages.items():
        for latex in math_of(markdown):
            reader = read(latex, composites)
            for found, names in ((used, reader.symbols), (operators, reader.operators)):
                for name in names:
                    found.setdefault(name, set()).add(key)
            for name in reader.unknown:
                unknown.setdefault(name, set()).add(key)
    return used, operators, unknown


def _where(keys) -> str:
    return ", ".join(str(k) for k in sorted(keys, key=lambda k: (isinstance(k, str), k)))


def _rows_problems(rows, used, kind) -> list:
    problems, owner = [], {}
    for names, _, _ in rows:
        for name in dict.fromkeys(names):
            if name in owner:
                problems.append(f"{kind} ${name}$ has two rows")
            owner[name] = names
    for name in sorted(set(used) - set(owner)):
        problems.append(f"{kind} ${name}$ (in {_where(used[name])}) has no row in notation.md")
    for names, _, listed in rows:
        actual = set().union(*(used.get(n, set()) for n in names))
        actual = {k for k in actual if isinstance(k, int)}
        if actual != listed:
            problems.append(
                f"{kind} row {', '.join(names)}: lists chapters {_where(listed) or '—'}, "
                f"used in {_where(actual) or 'none'}"
            )
    return problems


def forbidden(pages: dict, composites=COMPOSITES) -> list:
    problems = []
    for key, markdown in pages.items():
        if key == "notation":
            continue  # the page may name what it retires
        for latex in math_of(markdown):
            for name in set(read(latex, composites).symbols) & set(FORBIDDEN_SYMBOLS):
                problems.append(f"{key}: ${latex.strip()}$ uses {name}: {FORBIDDEN_SYMBOLS[name]}")
            for pattern, why in FORBIDDEN_SPELLINGS.items():
                if re.search(pattern, latex):
                    problems.append(f"{key}: ${latex.strip()}$: {why}")
    return problems


def notation_problems(pages: dict, notation: str) -> list:
    """Everything that breaks one letter, one meaning, for the book's pages and its table."""
    symbol_rows = declared(table(notation, "Symbols"))
    function_rows = declared(table(notation, "Functions"), functions=True)
    composites = COMPOSITES | {n for names, _, _ in symbol_rows for n in names if "_" in n}
    used, operators, unknown = usage(pages, composites)
    problems = [f"unknown command {c} (in {_where(k)})" for c, k in sorted(unknown.items())]
    problems += _rows_problems(symbol_rows, used, "symbol")
    problems += _rows_problems(function_rows, operators, "function")
    return problems + forbidden(pages, composites)


def test_the_notation_page_lists_every_symbol_with_its_chapters():
    problems = notation_problems(book_markdown(), NOTATION.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_extraction():
    assert sorted(symbols(r"z_{ij} = \frac{q_i\cdot k_j}{\sqrt{d_k}} + M_{ij}")) == sorted(
        ["z", "i", "j", "q", "i", "k", "j", "d_k", "M", "i", "j"]
    )
    assert symbols(r"W_{QK} = W_Q W_K^\top,\ d_\text{model},\ H_{kv}") == [
        "W_{QK}", "W_Q", "W_K", "d_{\\text{model}}", "H_{kv}"
    ]  # fmt: skip
    found = symbols(r"\operatorname{lse}_i = m_i + \log\ell_i")
    assert sorted(found) == ["\\ell", "i", "i", "i", "m"]
    assert read(r"\operatorname*{mean}_{i \ge 1} A^{(h)}_{i,\,i-1}").operators == ["mean"]
    assert symbols(r"\text{FLOPs} = 4T^2D,\ \mathbb{E}[e],\ \mathrm{d}V,\ \bar q'") == [
        "T", "D", "\\mathbb{E}", "e", "\\mathrm{d}", "V", "\\bar{q}"
    ]  # fmt: skip
    assert symbols(r"\hat q = \bar q \odot \gamma^q, \quad \gamma^{q}_{\max}") == [
        "\\hat{q}", "\\bar{q}", "\\gamma^q", "\\gamma^q"
    ]  # fmt: skip
    assert read(r"\varkappa + \mathcal{O}(T^2)").unknown == ["\\varkappa"]
    assert read(r"R^{\text{half}}, H_q", table=True).symbols == ["R^{\\text{half}}", "H_q"]
    assert chapter_list("1-3, 8, 12–13") == {1, 2, 3, 8, 12, 13}


PLANTED_NOTATION = """
## Symbols

| symbol | meaning | chapters |
|---|---|---|
| $q$, $k$ | a query, a key | 1, 2 |
| $i$, $j$ | indices | 1 |
| $z$ | a score | 1 |

## Functions

| function | meaning | chapters |
|---|---|---|
| $\\operatorname{softmax}$ | the softmax | 1 |
"""


def test_the_check_finds_a_planted_unknown_symbol_and_a_wrong_chapter_list():
    good = {1: "$z_{ij} = q_i \\cdot k_j$ and $\\operatorname{softmax}(z)$", 2: "a $q$"}
    assert notation_problems(good, PLANTED_NOTATION) == []
    unknown = {**good, 2: "a $q$ and $Y$"}
    assert notation_problems(unknown, PLANTED_NOTATION) == [
        "symbol $Y$ (in 2) has no row in notation.md"
    ]
    moved = {1: good[1], 3: "a $q$"}  # q moves to chapter 3: the row's list is wrong
    assert notation_problems(moved, PLANTED_NOTATION) == [
        "symbol row q, k: lists chapters 1, 2, used in 1, 3"
    ]
    twice = PLANTED_NOTATION.replace("| $z$ | a score | 1 |", "| $z$, $q$ | a score | 1 |")
    assert "symbol $q$ has two rows" in notation_problems(good, twice)


def test_the_check_finds_forbidden_letters_and_spellings():
    planted = {
        "$\\partial L/\\partial z$": "uses L",
        "$\\Theta = 10^4$, with $b$ bytes per number": "uses b",
        "$P_{ij} = e^{z_{ij}}$": "weights are A",
        "$\\mathrm{d}P = \\mathrm{d}O\\,V^\\top$": "weights are A",
        "$dV = A^\\top \\mathrm{d}O$": "a gradient is",
        "$\\Theta\\!\\left(TD\\right)$": "an order is",
        "$O(T^2)$": "an order is",
        "$K^T$": "a transpose is",
        "$\\delta_{ij}$": "Kronecker",
    }
    for markdown, reason in planted.items():
        found = forbidden({1: markdown})
        assert len(found) == 1 and reason in found[0], (markdown, found)
    clean = "$\\mathcal{L}$, $\\mathrm{d}V = A^\\top\\mathrm{d}O$, $K^\\top$, $\\mathcal{O}(T^2)$"
    assert forbidden({1: clean + ", $P\\,W_{QK}P^\\top$, $\\mathbb{R}^{T\\times D}$"}) == []
