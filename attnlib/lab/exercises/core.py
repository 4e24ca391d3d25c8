"""The checker: `check(name, fn)` runs the reader's function against the reference and says why.

The verdict is plain text wrapped at the page's 80 columns (a rich display in Jupyter, with the
section of a recognised bug as a link to the book). Its first line says passed or not yet and
what is wrong; the lines after it give the first failing case, the cases run and the tolerance.
"""

import functools
import html
import linecache
import math
import os
import re
import site
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

RTOL, ATOL = 1e-3, 1e-4  # float32 answers against float64 references
BOOK_URL = "https://attention-first-principles.github.io/attention-book/"
WIDTH = 80  # the page's columns
SHOWN_CASES = 6  # at most this many case labels are listed; else the first five and a count


class Section(NamedTuple):
    """A heading of the book: its notebook, number (5.4, 5.6.1) and text as in the notebook."""

    chapter: str  # notebook stem, "05_causal_masking"
    number: str
    title: str  # markdown, e.g. "The `is_causal` pitfall: SDPA's top-left triangle"
    repeat: int = 0  # earlier headings of the page with the same slug (MyST appends -1, -2)

    @property
    def slug(self) -> str:
        """MyST's default heading slug: inline math dropped, code kept without its backticks."""
        text = re.sub(r"\$[^$]*\$", "", self.title).replace("`", "")
        slug = re.sub(r"[^\w\u4e00-\u9fff\- ]", "", text.lower().replace(" ", "-"))
        for i in range(1, self.repeat + 1):
            slug = f"{slug}-{i}"
        return slug

    @property
    def url(self) -> str:
        return f"{BOOK_URL}notebooks/{self.chapter}.html#{self.slug}"

    def __str__(self) -> str:
        return f"§{self.number}, {self.title.replace('`', '')}"


class Bug(NamedTuple):
    """One known mistake: what goes wrong, and the section of the book that shows it."""

    explanation: str
    section: Section


class Case(NamedTuple):
    """The arguments of one call of the reader's function, and a label for messages."""

    args: tuple
    label: str


class Exercise(NamedTuple):
    """An exercise: its signature, one line of description, cases, reference and bugs."""

    signature: str
    description: str
    cases: Callable  # () -> [Case]
    reference: Callable  # the exercise's signature, float64 answers
    outputs: tuple  # names and shapes of the outputs, e.g. ("out [B, H, T, D]",)
    bugs: dict  # bug name (a key of BUGS) -> wrong function with the exercise's signature
    probe: Optional[Callable] = None  # () -> (args with v = identity, allowed [.., T, S])


@dataclass(frozen=True)
class Result:
    """The verdict of `check`.

    passed; diagnosis: the name of the recognised bug (a key of BUGS) or None; message: what is
    wrong (or right) and the first failing case, on one line; section: the Section of the named
    bug or None; text: the whole verdict as printed.
    """

    passed: bool
    diagnosis: Optional[str]
    message: str
    section: Optional[Section] = None
    text: str = ""


class _Fail(Exception):
    """A message for the reader; raised inside `check` and never leaves it."""


# ---- calling the reader's function --------------------------------------------------------


def _copy(args):
    return tuple(
        a.clone() if torch.is_tensor(a) else list(a) if isinstance(a, list) else a for a in args
    )


def _where(i: int, n: int, case: Case) -> str:
    return f"case {i} of {n}: {case.label}"


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple:
    """The folders whose code is not the reader's: torch, attnlib, the standard library and
    installed packages."""
    import attnlib

    dirs = [os.path.dirname(torch.__file__), os.path.dirname(attnlib.__file__)]
    paths = sysconfig.get_paths()
    dirs += [paths.get("stdlib"), paths.get("platstdlib"), paths.get("purelib")]
    dirs += [paths.get("platlib"), getattr(site, "USER_SITE", None)]
    if hasattr(site, "getsitepackages"):
        dirs += site.getsitepackages()
    return tuple({os.path.realpath(d) + os.sep for d in dirs if d})


def _reader_line(err: BaseException):
    """(line number, text) of the innermost frame of the reader's own code, else None."""
    found, tb = None, err.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        text = linecache.getline(filename, tb.tb_lineno).strip()
        if filename.startswith("<"):  # <string>, <frozen ...>: the reader's only if we can read
            ours = bool(text)
        else:
            ours = not os.path.realpath(filename).startswith(_library_dirs())
        if ours:
            found = (tb.tb_lineno, text)
        tb = tb.tb_next
    return found


def _raised(err: Exception, where: str) -> str:
    """One line: the exception, its message, and the reader's line that raised it."""
    at = ""
    try:
        line = _reader_line(err)
    except Exception:  # a frame we cannot read costs the line, never the verdict
        line = None
    if line:
        number, text = line
        text = text if len(text) <= 60 else text[:57] + "..."
        at = f" at line {number}, `{text}`" if text else f" at line {number}"
    words = " ".join(str(err).split())
    words = words if len(words) <= 300 else words[:297] + "..."
    return (
        f"Your function raised {type(err).__name__}{at}{': ' + words if words else ''} ({where})."
    )


def _call(fn, ex: Exercise, i: int, n: int, case: Case):
    """Call fn on copies of the case's args; return its outputs as a tuple of float64 tensors."""
    given = _copy(case.args)
    try:
        out = fn(*given)
    except NotImplementedError:
        raise _Fail(
            "Not implemented yet: the function raises NotImplementedError. Replace the `raise` "
            "with your code."
        ) from None
    except Exception as err:  # the reader's code may raise anything
        raise _Fail(_raised(err, _where(i, n, case))) from None
    names = ex.signature[3 : ex.signature.index(")")].split(", ")  # "fn(q, k, v) -> .."
    for name, a, b in zip(names, case.args, given):
        if torch.is_tensor(a) and (not torch.is_tensor(b) or not torch.equal(a, b)):
            raise _Fail(
                f"Your function changed its input `{name}` in place; work on new tensors "
                f"(x = x * s, not x *= s) ({_where(i, n, case)})."
            )
    want = len(ex.outputs)
    if want > 1:
        if not isinstance(out, (tuple, list)) or len(out) != want:
            raise _Fail(
                f"Expected a tuple of {want} tensors ({', '.join(ex.outputs)}), "
                f"got {_describe(out)}."
            )
    else:
        out = (out,)
    result = []
    for o, name in zip(out, ex.outputs):
        if "(a number)" in name:
            result.append(_number(o, name))
            continue
        if not torch.is_tensor(o):
            raise _Fail(f"Expected a torch.Tensor for {name}, got {type(o).__name__}.")
        if not o.is_floating_point():
            raise _Fail(f"Expected a real floating-point tensor for {name}, got {o.dtype}.")
        result.append(o.detach().cpu().double())
    return tuple(result)


def _number(o, name: str) -> torch.Tensor:
    """A count the reader returned (int, float or one-element tensor) as a float64 scalar."""
    if torch.is_tensor(o) and o.numel() == 1 and not o.is_complex() and o.dtype != torch.bool:
        return o.detach().cpu().double().reshape(())
    if isinstance(o, (int, float)) and not isinstance(o, bool):
        return torch.tensor(float(o), dtype=torch.float64)
    raise _Fail(f"Expected a number for {name.split()[0]}, got {type(o).__name__}.")


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def _as_tuple(x):
    xs = x if isinstance(x, (tuple, list)) else (x,)
    return tuple(t.double() if torch.is_tensor(t) else torch.tensor(float(t)).double() for t in xs)


def _close(outs, exps, nan_as_zero=False):
    if len(outs) != len(exps) or any(o.shape != e.shape for o, e in zip(outs, exps)):
        return False
    if nan_as_zero:
        outs, exps = (
            [x.nan_to_num(0.0, posinf=math.inf, neginf=-math.inf) for x in xs]
            for xs in (outs, exps)
        )
    return all(torch.allclose(o, e, RTOL, ATOL) for o, e in zip(outs, exps))


# ---- what is wrong -----------------------------------------------------------------------


def _index(flat: int, shape) -> list:
    return [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(shape))] if shape else []


def _entry(name: str, idx: list) -> str:
    return f"{name}[{', '.join(map(str, idx))}]" if idx else name


def _pair(got: float, want: float) -> tuple:
    """The two numbers with enough digits to tell them apart."""
    for digits in (4, 8, 17):
        g, w = f"{got:.{digits}g}", f"{want:.{digits}g}"
        if g != w:
            break
    return g, w


def _failing_case(ex: Exercise, cases, outs, exps):
    """The first failing case: its place, largest difference and first wrong entry; else None."""
    for i, (c, o, e) in enumerate(zip(cases, outs, exps), 1):
        for got, want, what in zip(o, e, ex.outputs):
            bad = ~torch.isclose(got, want, RTOL, ATOL)
            if not bad.any():
                continue
            name = what.split()[0]
            diff = (got - want).abs()[bad].max()
            largest = f"{float(diff):.3g}" if torch.isfinite(diff) else "not finite"
            idx = _index(int(bad.flatten().nonzero()[0]), got.shape)
            g, w = _pair(float(got[tuple(idx)]), float(want[tuple(idx)]))
            of = f" of {name}" if len(ex.outputs) > 1 else ""
            return (
                f"First failing case: {i} of {len(cases)} ({c.label}); largest difference{of} "
                f"{largest}; first wrong entry {_entry(name, idx)} = {g}, expected {w}."
            )
    return None


def _shape_message(ex: Exercise, cases, outs, exps):
    """The first output whose shape differs from the reference's, as a message; else None."""
    for i, (c, o, e) in enumerate(zip(cases, outs, exps), 1):
        for got, want, what in zip(o, e, ex.outputs):
            if got.shape != want.shape:
                hint = (
                    " (the right axes in the wrong order?)"
                    if sorted(got.shape) == sorted(want.shape)
                    else ""
                )
                return (
                    f"{what.split()[0]} has shape {list(got.shape)}, expected "
                    f"{list(want.shape)} = {what.split(' ', 1)[1]}{hint} "
                    f"({_where(i, len(cases), c)})."
                )
    return None


def _matching_bug(ex: Exercise, cases, outs):
    """The first of ex.bugs whose wrong version gives these outputs on every case; else None."""
    for bug, wrong in ex.bugs.items():
        try:
            if all(
                _close(o, _as_tuple(wrong(*c.args)), nan_as_zero=True) for c, o in zip(cases, outs)
            ):
                return bug
        except Exception:  # a wrong version that cannot run on these arguments is not this one
            continue
    return None


def _nan_message(ex: Exercise, cases, outs):
    """Where the first NaN of the outputs is, as a message; else None."""
    for i, (c, o) in enumerate(zip(cases, outs), 1):
        for got, what in zip(o, ex.outputs):
            if got.isnan().any():
                name = what.split()[0]
                idx = _index(int(got.isnan().flatten().nonzero()[0]), got.shape)
                return (
                    f"{name} has NaN, first at {_entry(name, idx)} ({_where(i, len(cases), c)}); "
                    "a softmax over a row that is all -inf gives NaN, and so does exp of a score "
                    "too large for the dtype (inf / inf)."
                )
    return None


def _probe_finding(fn, ex: Exercise):
    """With v = identity attention returns its weights: name future keys and bad row sums."""
    if ex.probe is None:
        return None
    try:
        args, allowed = ex.probe()
        weights = fn(*_copy(args)).detach().cpu().double()
        allowed = allowed.expand_as(weights)
        if weights.isnan().any() or (weights < -1e-4).any():  # these are not weights
            return None
    except Exception:
        return None
    how = "(probed with v = identity, so the output is the weights)"
    leak = (weights.abs() > 1e-4) & ~allowed
    if leak.any():
        idx = _index(int(leak.flatten().nonzero()[0]), weights.shape)
        i, j = idx[-2:]
        return (
            f"Query {i} gives weight {float(weights[tuple(idx)]):.3g} to key {j}, which it "
            f"must not see {how}."
        )
    sums = weights.sum(-1)  # [..., T]
    off = ((sums - 1).abs() > 1e-3) & allowed.any(-1)
    if off.any():
        idx = _index(int(off.flatten().nonzero()[0]), sums.shape)
        return f"The weights of query {idx[-1]} sum to {float(sums[tuple(idx)]):.4g}, not 1 {how}."
    return None


def _diagnose(fn, ex: Exercise, bugs: dict, cases, outs, exps):
    """(bug name or None, what is wrong as segments, the first failing case or None)."""
    shape = _shape_message(ex, cases, outs, exps)
    if shape:
        return None, [shape], None
    failing = _failing_case(ex, cases, outs, exps)
    bug = _matching_bug(ex, cases, outs)
    if bug:
        head = f"It looks like `{bug}`. {bugs[bug].explanation} See "
        return bug, [head, bugs[bug].section, "."], failing
    found = _nan_message(ex, cases, outs) or _probe_finding(fn, ex)
    return None, [found or "The shapes are right; the values are not."], failing


# ---- the verdict -------------------------------------------------------------------------


def _case_list(cases) -> str:
    labels = [c.label for c in cases]
    if len(labels) <= SHOWN_CASES:
        return "; ".join(labels) + "."
    return "; ".join(labels[: SHOWN_CASES - 1]) + f"; and {len(labels) - SHOWN_CASES + 1} more."


def _tolerance() -> str:
    def short(x):
        return f"{x:.0e}".replace("e-0", "e-")

    return f"Tolerance: rtol {short(RTOL)}, atol {short(ATOL)}, against a float64 reference."


def _plain(segments) -> str:
    return "".join(str(s) for s in segments)


def _text(headline: str, parts) -> str:
    """The plain verdict: each part starts its own line, continuation lines indented by two."""
    lines = [textwrap.fill(f"{headline} {_plain(parts[0])}", WIDTH, subsequent_indent="  ")]
    for part in parts[1:]:
        lines.append(
            textwrap.fill(_plain(part), WIDTH, initial_indent="  ", subsequent_indent="  ")
        )
    return "\n".join(lines)


def _html_segment(segment) -> str:
    if isinstance(segment, Section):
        title = html.escape(str(segment))
        return f'<a href="{html.escape(segment.url)}" target="_blank">{title}</a>'
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(segment))


def _html(headline: str, passed: bool, parts) -> str:
    color = "#2e7d32" if passed else "#b26a00"
    paragraphs = ["".join(_html_segment(s) for s in part) for part in parts]
    paragraphs[0] = f"<strong>{html.escape(headline)}</strong> {paragraphs[0]}"
    body = "".join(f'<p style="margin: 0.15em 0">{p}</p>' for p in paragraphs)
    style = f"border-left: 4px solid {color}; padding-left: 0.6em"
    return f'<div class="attnlib-check" style="{style}">{body}</div>'


def _show(text: str, html_text: str) -> None:
    """A rich display inside a Jupyter kernel, with the text as fallback; else print."""
    ipython = sys.modules.get("IPython")  # never imported here: only used when already there
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        if shell is not None and hasattr(shell, "kernel"):
            from IPython.display import display

            display({"text/plain": text, "text/html": html_text}, raw=True)
            return
    except Exception:
        pass
    print(text)


def check(name: str, fn: Callable, extra=()) -> Result:
    """Run fn against exercise `name` (a key of EXERCISES); show the verdict and return it.

    fn has the exercise's signature (see EXERCISES[name].signature). `extra`: more argument
    tuples to try after the seeded cases. A bug of the bank is named only when the answer
    reproduces it on every case.
    """
    from . import BUGS, EXERCISES  # the registry, which imports this module

    if name not in EXERCISES:
        raise ValueError(f"no exercise {name!r}; the exercises are {', '.join(EXERCISES)}")
    ex = EXERCISES[name]
    passed, diagnosis, failing, cases, stub = False, None, None, [], False
    try:
        cases = ex.cases() + [Case(tuple(args), f"extra {i}") for i, args in enumerate(extra)]
        if not callable(fn):
            raise _Fail(f"Expected a function, got {type(fn).__name__}.")
        outs = [_call(fn, ex, i, len(cases), c) for i, c in enumerate(cases, 1)]
        exps = [_as_tuple(ex.reference(*c.args)) for c in cases]
        if all(_close(o, e) for o, e in zip(outs, exps)):
            passed, head = True, [f"Correct on all {len(cases)} cases."]
        else:
            diagnosis, head, failing = _diagnose(fn, ex, BUGS, cases, outs, exps)
    except _Fail as fail:
        head, stub = [str(fail)], str(fail).startswith("Not implemented yet")
    except Exception as err:  # the checker itself must never hand the reader a traceback
        head = [f"Could not check this answer ({type(err).__name__}: {err})."]
    parts = [head] + [[failing]] * bool(failing)
    if cases:
        parts.append([("Cases it will run: " if stub else "Cases: ") + _case_list(cases)])
    parts.append([_tolerance()])
    headline = f"{name}: {'passed' if passed else 'not yet'}."
    text = _text(headline, parts)
    _show(text, _html(headline, passed, parts))
    section = BUGS[diagnosis].section if diagnosis else None
    message = " ".join(_plain(p) for p in parts[: 1 + bool(failing)])
    return Result(passed, diagnosis, message, section, text)
