"""Chapter 1, context vectors: attention with no parameters, every token against every token."""

import torch

from ...softmax import softmax
from .cases import randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "01_context"

BUGS = {
    "plain_sum_weights": Bug(
        "The scores were divided by their sum instead of passed through the softmax: negative "
        "scores give negative weights, and a row whose scores sum to nearly 0 explodes.",
        Section(CHAPTER, "1.5.1", "Why the softmax, and not just dividing by the sum?"),
    ),
    "weights_over_columns": Bug(
        "The softmax ran down the columns (dim=0), so each key's weights sum to 1 and each "
        "token's do not; normalise along each row, over the tokens a token looks at.",
        Section(CHAPTER, "1.7", "Every token at once"),
    ),
}


def _reference(x):
    x = x.double()
    return softmax(x @ x.T) @ x


def _plain_sum(x):
    scores = x.double() @ x.double().T
    return scores / scores.sum(-1, keepdim=True) @ x.double()


def _over_columns(x):
    x = x.double()
    return softmax(x @ x.T, dim=0) @ x


def _cases():
    gen = torch.Generator().manual_seed(11)
    return [Case((randn(gen, t, d),), f"T={t}, d={d}") for t, d in [(6, 3), (4, 5), (1, 2), (7, 4)]]


EXERCISES = {
    "context_vectors": Exercise(
        "fn(x) -> out; x [T, d] -> [T, d]",
        "Attention with no parameters: row i of the output mixes the rows of x with the weights "
        "softmax(x x^T) of row i; every token sees every token, no scale.",
        _cases,
        _reference,
        ("out [T, d]",),
        {"plain_sum_weights": _plain_sum, "weights_over_columns": _over_columns},
    ),
}
