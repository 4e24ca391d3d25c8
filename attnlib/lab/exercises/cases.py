"""What several chapters' exercises share: seeded tensors, q/k/v cases, float64 attention, probes.

The references and the wrong versions take the reader's arguments and answer in float64.
"""

import math

import torch

from ...attention import causal_attention
from ...softmax import softmax
from .core import Case


def f64(*xs):
    """The floating-point tensors among xs in float64; everything else as it is."""
    return tuple(x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in xs)


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def tril(t, s, offset=0):
    """Boolean [t, s], True on and below the diagonal shifted by offset."""
    return torch.ones(t, s, dtype=torch.bool).tril(offset)


def attend(q, k, v, visible, scale=None, dim=-1, after=None):
    """Dense attention in float64 with boolean visible [T, S]: the template of several bugs.

    dim: the axis of the softmax; after: None (mask the scores with -inf), "zero" (zero the
    weights after the softmax) or "renormalise" (zero them and divide by the rows' sums).
    """
    q, k, v = f64(q, k, v)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # [B, H, T, S]
    if after is None:
        return softmax(scores.masked_fill(~visible, -math.inf), dim=dim) @ v
    weights = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    if after == "renormalise":
        weights = weights / weights.sum(-1, keepdim=True)  # 0/0 = NaN where the future won
    return weights @ v


def ref_causal(q, k, v):
    """Causal attention in float64; the T queries are the last T of the S positions."""
    return causal_attention(*f64(q, k, v))


def qkv_cases(shapes, seed, spike=False):
    """q [B, Hq, T, D], k and v [B, Hkv, S, D] for each (B, Hq, Hkv, T, S, D) in shapes.

    spike: one more case in which the last key outscores the others by thousands, so that only
    its own query may see it.
    """
    gen, cases = torch.Generator().manual_seed(seed), []
    for b, hq, hkv, t, s, d in shapes:
        q, k, v = randn(gen, b, hq, t, d), randn(gen, b, hkv, s, d), randn(gen, b, hkv, s, d)
        heads = f"H={hq}" if hq == hkv else f"Hq={hq}, Hkv={hkv}"
        tokens = f"T={t}" if s == t else f"T={t}, S={s}"
        cases.append(Case((q, k, v), f"B={b}, {heads}, {tokens}, D={d}"))
    if spike:
        b, h, t, d = 1, 2, 5, 8
        q = randn(gen, b, h, t, d).abs() + 0.5
        k, v = randn(gen, b, h, t, d), randn(gen, b, h, t, d)
        k[:, :, -1] = 1000.0
        cases.append(Case((q, k, v), f"B={b}, H={h}, T={t}, D={d}, one future key outscores all"))
    return cases


def identity_probe(hq=2, hkv=2, t=6, s=6):
    """((q, k, v), allowed): with v = identity [S, S] attention outputs its weights [.., T, S].

    allowed [T, S] is the causal rule with the T queries at the last T of the S positions.
    """
    gen = torch.Generator().manual_seed(10)
    q, k = randn(gen, 1, hq, t, s), randn(gen, 1, hkv, s, s)
    v = torch.eye(s).expand(1, hkv, s, s).clone()
    return (q, k, v), tril(t, s, s - t)
