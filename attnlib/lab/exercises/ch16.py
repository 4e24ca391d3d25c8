"""Chapter 16, the backward pass: the gradients of causal attention without autograd."""

import math

import torch

from ...attention import causal_attention
from ...softmax import softmax
from .cases import f64, randn, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "16_backward"

BUGS = {
    "backward_without_delta": Bug(
        "dZ = A * (dA - delta) needs the row-sum term delta_i = dO_i . O_i; without it dq and dk "
        "are wrong (dv is right).",
        Section(CHAPTER, "16.1", "The backward pass, derived"),
    ),
}


def _reference(q, k, v, dout):
    q, k, v, dout = (x.double().requires_grad_() for x in (q, k, v, dout))
    with torch.enable_grad():
        return torch.autograd.grad(causal_attention(q, k, v), (q, k, v), dout)


def _without_delta(q, k, v, dout):
    q, k, v, dout = f64(q, k, v, dout)
    scale, t = 1 / math.sqrt(q.shape[-1]), q.shape[2]
    p = softmax((q @ k.transpose(-2, -1) * scale).masked_fill(~tril(t, t), -math.inf))
    ds = p * (dout @ v.transpose(-2, -1))  # the bug: no "- delta"
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


def _cases():
    gen, cases = torch.Generator().manual_seed(8), []
    for b, h, t, d in [(2, 2, 5, 8), (1, 3, 4, 4), (1, 1, 6, 16)]:
        args = tuple(randn(gen, b, h, t, d) for _ in range(4))
        cases.append(Case(args, f"B={b}, H={h}, T={t}, D={d}"))
    return cases


EXERCISES = {
    "attention_backward": Exercise(
        "fn(q, k, v, dout) -> (dq, dk, dv); all [B, H, T, D]",
        "The gradients of causal attention (scale 1/sqrt(D)) given dout, without autograd.",
        _cases,
        _reference,
        ("dq [B, H, T, D]", "dk [B, H, T, D]", "dv [B, H, T, D]"),
        {"backward_without_delta": _without_delta},
    ),
}
