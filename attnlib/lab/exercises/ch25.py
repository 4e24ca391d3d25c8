"""Chapter 25, attention without the softmax: one step of the gated delta rule (eq. 25.9)."""

import torch
import torch.nn.functional as F

from .cases import f64, randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "25_linear_attention"
DELTA = Section(CHAPTER, "25.2.1", "The delta rule: write the correction")

BUGS = {
    "delta_decay_after_write": Bug(
        "The decay multiplies the state after the write, so the new pair is shrunk by alpha "
        "too: decay first, then read, correct and write.",
        DELTA,
    ),
    "delta_read_before_decay": Bug(
        "The correction reads the state before the decay: the write must remove what the "
        "decayed state alpha * Omega recalls for k, not what the old state recalled.",
        DELTA,
    ),
    "delta_additive_write": Bug(
        "The write adds eta k^T v without subtracting what the state already recalls for k: "
        "that is linear attention's sum with a decay, not the delta rule.",
        DELTA,
    ),
}


def _step(state, k, v, alpha, eta, bug=None):
    state, k, v, alpha, eta = f64(state, k, v, alpha, eta)
    a, e = alpha[..., None, None], eta[..., None, None]
    decayed = a * state  # [B, H, D, Dv]
    seen = state if bug in ("read_before_decay", "after") else decayed
    read = (k[..., None] * seen).sum(-2)  # k Omega, [B, H, Dv]
    write = v if bug == "additive" else v - read
    if bug == "after":  # write into the old state, then decay everything
        return a * (state + e * k[..., :, None] * write[..., None, :])
    return decayed + e * k[..., :, None] * write[..., None, :]


def _cases():
    gen, cases = torch.Generator().manual_seed(25), []
    for b, h, d, dv in [(1, 1, 4, 3), (2, 3, 8, 8), (1, 2, 16, 4)]:
        state = randn(gen, b, h, d, dv)
        k = F.normalize(randn(gen, b, h, d), dim=-1)
        v = randn(gen, b, h, dv)
        alpha = 0.5 + 0.5 * torch.rand(b, h, generator=gen)
        eta = 0.2 + 0.8 * torch.rand(b, h, generator=gen)
        cases.append(Case((state, k, v, alpha, eta), f"B={b}, H={h}, D={d}, Dv={dv}"))
    return cases


EXERCISES = {
    "gated_delta_step": Exercise(
        "fn(state, k, v, alpha, eta) -> new_state; state [B, H, D, Dv], k [B, H, D], "
        "v [B, H, Dv], alpha and eta [B, H]",
        "One step of the gated delta rule: decay the state by alpha, read what it recalls "
        "for the unit key k, and write eta times the correction v - k Omega under k.",
        _cases,
        _step,
        ("new_state [B, H, D, Dv]",),
        {
            "delta_decay_after_write": lambda *a: _step(*a, bug="after"),
            "delta_read_before_decay": lambda *a: _step(*a, bug="read_before_decay"),
            "delta_additive_write": lambda *a: _step(*a, bug="additive"),
        },
    ),
}
