"""Chapter 24, past the training length: ALiBi's slopes for any number of heads (eq. 24.6)."""

import math

import torch

from .core import Bug, Case, Exercise, Section

CHAPTER = "24_long_context"
ALIBI = Section(CHAPTER, "24.5", "ALiBi: a bias in place of a rotation")

BUGS = {
    "alibi_next_power": Bug(
        "These are the first H slopes of the next power of two, 2**(-8h/H') with H' > H: "
        "eq. 24.6 takes all H' = 2**floor(log2 H) slopes of the power below, then every other "
        "slope of 2H' heads for the rest.",
        ALIBI,
    ),
    "alibi_formula_for_any_h": Bug(
        "2**(-8h/H) is the rule for a power of two only: for other H it makes a geometric "
        "sequence whose ratio is not a power of one half. Take the H' = 2**floor(log2 H) slopes "
        "of the power below, then the odd-numbered slopes of 2H' heads (eq. 24.6).",
        ALIBI,
    ),
    "alibi_from_zero": Bug(
        "The heads were counted from h = 0, so the first slope is 2**0 = 1 and the last never "
        "reaches 2**-8: eq. 24.6 counts h = 1, ..., H.",
        ALIBI,
    ),
}


def _power(heads, start=1):
    return [2.0 ** (-8.0 * h / heads) for h in range(start, heads + start)]


def _slopes(heads, bug=None):
    """Eq. 24.6 in float64, or one of the named wrong versions."""
    if bug == "next_power":
        return torch.tensor(_power(2 ** math.ceil(math.log2(heads)))[:heads], dtype=torch.float64)
    if bug == "any_h":
        return torch.tensor(_power(heads), dtype=torch.float64)
    start = 0 if bug == "from_zero" else 1
    power = 2 ** math.floor(math.log2(heads))
    slopes = _power(power, start)
    if power != heads:
        slopes += _power(2 * power, start)[0::2][: heads - power]
    return torch.tensor(slopes, dtype=torch.float64)


def _cases():
    return [Case((h,), f"H={h}") for h in (8, 12, 1, 2, 3, 5, 6, 16, 20, 24, 40)]


EXERCISES = {
    "alibi_slopes": Exercise(
        "fn(heads) -> slopes; heads an int >= 1 -> slopes [H], the power of two's first",
        "ALiBi's slope of each head (eq. 24.6), for a number of heads that need not be a "
        "power of two.",
        _cases,
        _slopes,
        ("slopes [H]",),
        {
            "alibi_next_power": lambda h: _slopes(h, "next_power"),
            "alibi_formula_for_any_h": lambda h: _slopes(h, "any_h"),
            "alibi_from_zero": lambda h: _slopes(h, "from_zero"),
        },
    ),
}
