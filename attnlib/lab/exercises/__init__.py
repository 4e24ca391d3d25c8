"""The book's exercises and their checker, which names the bug it recognises (torch only).

`check(name, fn)` runs the reader's `fn` and the reference on a few seeded cases and shows a
verdict: passed or not yet, what is wrong, the first failing case, the cases and the tolerance.
Where the answer is wrong, it is run against every known wrong version of the exercise; a bug
of the bank `BUGS` is named only when it reproduces the reader's output, to tolerance, on every
case, and the verdict points to the section of the book that shows it.

One module per chapter (ch01.py, ch02.py, ...) holds that chapter's exercises whole: references,
cases, wrong versions and the bugs it introduces (`BUGS`), with `BORROWED` naming the bugs it
shares with an earlier chapter. This registry finds the chapter modules and gathers them, in
chapter order, into `EXERCISES` (name -> Exercise) and `BUGS` (bug name -> Bug); a name defined
twice stops the import.
"""

import importlib
import pkgutil
import re

from .core import ATOL, BOOK_URL, RTOL, Bug, Case, Exercise, Result, Section, check

CHAPTERS = tuple(  # ch01, ch02, ...: every chapter module of this folder, in chapter order
    importlib.import_module(f"{__name__}.{name}")
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__))
    if re.fullmatch(r"ch\d\d", name)
)


def register(modules) -> tuple:
    """(EXERCISES, BUGS) from the chapter modules, in order; ValueError if a name is defined
    twice or an exercise names a bug its module neither defines nor borrows."""
    exercises, bugs = {}, {}
    for module in modules:
        for name, bug in module.BUGS.items():
            if name in bugs:
                raise ValueError(f"bug {name!r} is defined twice (again in {module.__name__})")
            bugs[name] = bug
        known = {**module.BUGS, **getattr(module, "BORROWED", {})}
        for name, exercise in module.EXERCISES.items():
            if name in exercises:
                raise ValueError(f"exercise {name!r} is defined twice (again in {module.__name__})")
            unknown = [bug for bug in exercise.bugs if bug not in known]
            if unknown:
                raise ValueError(f"{name} in {module.__name__} names unknown bugs {unknown}")
            exercises[name] = exercise
    return exercises, bugs


EXERCISES, BUGS = register(CHAPTERS)

__all__ = [
    "ATOL",
    "BOOK_URL",
    "BUGS",
    "EXERCISES",
    "RTOL",
    "Bug",
    "Case",
    "Exercise",
    "Result",
    "Section",
    "check",
]
