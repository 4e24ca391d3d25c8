"""Chapter 4, the softmax and its Jacobian: a softmax that does not overflow, and da/dz.
Defines softmax_without_max, which chapter 11's loops share."""

import math

import torch

from ...softmax import softmax
from .cases import randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "04_softmax_jacobian"
JACOBIAN = Section(CHAPTER, "4.3", "The Jacobian of the softmax")

BUGS = {
    "softmax_without_max": Bug(
        "exp(z) overflows for scores above about 88 in float32 (709 in float64) and inf/inf is "
        "NaN; subtract each row's maximum before exp.",
        Section(CHAPTER, "4.2", "The stable softmax"),
    ),
    "jacobian_diagonal_only": Bug(
        "Only the diagonal a_i (1 - a_i) is there: every weight depends on every score, so the "
        "off-diagonal entries -a_i a_j belong too.",
        JACOBIAN,
    ),
    "jacobian_sign_of_outer": Bug(
        "The outer product was added: the Jacobian is diag(a) - a a^T, and with the + its rows "
        "no longer sum to 0.",
        JACOBIAN,
    ),
}


def _ref_softmax(z):
    return softmax(z.double())


def _softmax_without_max(z):
    e = z.float().exp()  # float32, as a reader's tensors are: overflows above about 88
    return (e / e.sum(-1, keepdim=True)).double()


def _softmax_cases():
    gen = torch.Generator().manual_seed(15)
    large = torch.tensor([[1000.0, 999.0, 990.0, -5.0], [-1000.0, -1001.0, -1002.0, -1003.0]])
    masked = torch.tensor([[0.0, -math.inf, 1.0], [2.0, 2.0, -math.inf]])
    return [
        Case((3 * randn(gen, 3, 5),), "3 rows of 5 scores"),
        Case((large,), "scores near +1000 and -1000"),
        Case((masked,), "rows with a -inf score"),
        Case((randn(gen, 1, 1),), "one score"),
    ]


def _ref_jacobian(a):
    a = a.double()
    return torch.diag(a) - a[:, None] * a[None, :]


def _jacobian_cases():
    gen = torch.Generator().manual_seed(14)
    return [Case((softmax(2 * randn(gen, n)),), f"n={n}") for n in (4, 6, 2, 1)]


EXERCISES = {
    "stable_softmax": Exercise(
        "fn(z) -> a; z [R, n] -> [R, n]",
        "The softmax of each row (eq. 4.1), safe for scores of any size and for -inf entries.",
        _softmax_cases,
        _ref_softmax,
        ("a [R, n]",),
        {"softmax_without_max": _softmax_without_max},
    ),
    "softmax_jacobian": Exercise(
        "fn(a) -> jacobian; a [n], a softmax output -> [n, n]",
        "The Jacobian of the softmax from its output (eq. 4.2): entry (i, j) is da_i/dz_j.",
        _jacobian_cases,
        _ref_jacobian,
        ("jacobian [n, n]",),
        {
            "jacobian_diagonal_only": lambda a: torch.diag(a.double() * (1 - a.double())),
            "jacobian_sign_of_outer": lambda a: torch.diag(a.double()) + torch.outer(a, a).double(),
        },
    ),
}
