"""Chapter 20, circuits: the composition score of two heads, eq. 20.5."""

import torch

from .cases import randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "20_circuits"
COMPOSITION = Section(CHAPTER, "20.5", "Composition: which reader does layer 1 write for?")

BUGS = {
    "composition_not_normalised": Bug(
        "||W_QK W_OV||_F was not divided by ||W_QK||_F ||W_OV||_F, so the score grows with the "
        "size of the weights; normalised, it compares heads of any scale.",
        COMPOSITION,
    ),
    "composition_order_swapped": Bug(
        "The product ran the other way, W_OV W_QK: the earlier head's output (W_OV) is what the "
        "later head's W_QK reads, so the product is W_QK W_OV.",
        COMPOSITION,
    ),
}


def _composition(w_qk, w_ov, normalised=True, swapped=False):
    w_qk, w_ov = w_qk.double(), w_ov.double()
    product = w_ov @ w_qk if swapped else w_qk @ w_ov
    scale = torch.linalg.matrix_norm(w_qk) * torch.linalg.matrix_norm(w_ov) if normalised else 1
    return torch.linalg.matrix_norm(product) / scale


def _cases():
    gen = torch.Generator().manual_seed(19)
    return [Case((randn(gen, d, d), 3 * randn(gen, d, d)), f"d={d}") for d in (4, 8, 3, 16)]


EXERCISES = {
    "composition_score": Exercise(
        "fn(w_qk, w_ov) -> score; w_qk and w_ov [d, d] -> a number",
        "||W_QK W_OV||_F / (||W_QK||_F ||W_OV||_F): how much of the later head's W_QK reads "
        "what the earlier head's W_OV writes.",
        _cases,
        _composition,
        ("score (a number)",),
        {
            "composition_not_normalised": lambda w_qk, w_ov: _composition(
                w_qk, w_ov, normalised=False
            ),
            "composition_order_swapped": lambda w_qk, w_ov: _composition(w_qk, w_ov, swapped=True),
        },
    ),
}
