"""Chapter 11, compiled loops: one head, loop by loop. Borrows softmax_without_max from
chapter 4 and top_left_mask from chapter 7."""

import math

import torch

from .cases import randn, ref_causal, tril
from .ch04 import BUGS as CH04_BUGS
from .ch07 import BUGS as CH07_BUGS
from .ch07 import top_left
from .core import Case, Exercise

CHAPTER = "11_compiled_loops"

BUGS = {}
BORROWED = {
    "top_left_mask": CH07_BUGS["top_left_mask"],
    "softmax_without_max": CH04_BUGS["softmax_without_max"],
}


def _reference(q, k, v):
    return ref_causal(q[None, None], k[None, None], v[None, None])[0, 0]


def _top_left(q, k, v):
    return top_left(*(x[None, None] for x in (q, k, v)))[0, 0]


def _without_max(q, k, v):
    t, s = q.shape[0], k.shape[0]
    e = (q.float() @ k.float().T / math.sqrt(q.shape[-1])).exp()  # float32: inf above 88
    e = e.masked_fill(~tril(t, s, s - t), 0.0)
    return (e / e.sum(-1, keepdim=True)).double() @ v.double()


def _cases():
    gen, cases = torch.Generator().manual_seed(16), []
    for t, s, d, dv, largest in [
        (3, 5, 4, 2, 0),
        (4, 4, 8, 3, 0),
        (1, 6, 2, 2, 0),
        (2, 5, 4, 3, 800),
    ]:
        q, k, v = randn(gen, t, d), randn(gen, s, d), randn(gen, s, dv)
        label = f"T={t}, S={s}, D={d}, Dv={dv}"
        if largest:  # rescale so that the largest |score| is exactly `largest`
            grow = math.sqrt(largest / float((q @ k.T).abs().max() / math.sqrt(d)))
            q, k, label = q * grow, k * grow, label + f", scores up to {largest}"
        cases.append(Case((q, k, v), label))
    return cases


EXERCISES = {
    "attention_loops": Exercise(
        "fn(q, k, v) -> out; q [T, D], k [S, D], v [S, Dv] with T <= S -> [T, Dv]",
        "One head, loop by loop: query i (at position S-T+i) against the keys it may see, with "
        "the stable softmax and scale 1/sqrt(D).",
        _cases,
        _reference,
        ("out [T, Dv]",),
        {"top_left_mask": _top_left, "softmax_without_max": _without_max},
    ),
}
