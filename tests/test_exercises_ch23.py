"""Chapter 23's checked exercise, the absorbed MLA decode step: planted wrong answers are named,
correct answers in two styles pass. `PLANTED` and `CORRECT` have the shape of
tests/test_exercises.py's tables, so they can join them."""

import math

import torch

from attnlib.lab.exercises import BUGS, EXERCISES
from tests.test_exercises import assert_bugs_differ, correct_answers_test, named_bug_test


def turn(x, position):
    """RoPE, rotate-half, base 1e4, on x [..., d_R] at one position."""
    half = x.shape[-1] // 2
    angle = position * 10000.0 ** (-torch.arange(half, dtype=x.dtype) * 2 / x.shape[-1])
    cos, sin = torch.cat((angle.cos(), angle.cos())), torch.cat((angle.sin(), angle.sin()))
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def absorbed_einsum(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position):
    """The answer of the book: absorb, attend over the latents as one shared head, fold."""
    q_lat = torch.einsum("bhd,hcd->bhc", q_c, w_uk)  # [B, H, d_C]
    scale = 1 / math.sqrt(w_uk.shape[-1] + k_r.shape[-1])
    z = (q_lat @ c.transpose(1, 2) + turn(q_r, position) @ k_r.transpose(1, 2)) * scale
    o_c = torch.softmax(z, -1) @ c  # [B, H, d_C]
    return torch.einsum("bhc,hcm->bm", o_c, w_uv @ w_o)


def expanded_loops(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position):
    """Head by head, the keys and values expanded: the definition, no absorption."""
    out = 0
    for h in range(w_uk.shape[0]):
        k = torch.cat((c @ w_uk[h], k_r), -1)  # [B, S, Dn + d_R]
        q = torch.cat((q_c[:, h], turn(q_r[:, h], position)), -1)  # [B, Dn + d_R]
        a = torch.softmax((k @ q[..., None])[..., 0] / math.sqrt(k.shape[-1]), -1)  # [B, S]
        out = out + (a[:, None] @ (c @ w_uv[h]))[:, 0] @ w_o[h]
    return out


def rope_first(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position):
    return absorbed_einsum(turn(q_c, position), q_r, c, k_r, w_uk, w_uv, w_o, position)


def no_uv(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position):
    eye = torch.eye(w_uv.shape[1]).expand_as(w_uv)
    return absorbed_einsum(q_c, q_r, c, k_r, w_uk, eye, w_o, position)


def wide_scale(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position):
    ratio = math.sqrt((w_uk.shape[-1] + k_r.shape[-1]) / (c.shape[-1] + k_r.shape[-1]))
    return absorbed_einsum(q_c * ratio, q_r * ratio, c, k_r, w_uk, w_uv, w_o, position)


PLANTED = {  # bug -> (exercise, the reader's wrong answer), as in tests/test_exercises.py
    "mla_rope_before_absorption": ("absorbed_decode", rope_first),
    "mla_missing_uv_fold": ("absorbed_decode", no_uv),
    "mla_scale_latent_width": ("absorbed_decode", wide_scale),
}
CORRECT = {"absorbed_decode": [absorbed_einsum, expanded_loops]}
PAIRS = [(bug, ex, fn) for bug, (ex, fn) in PLANTED.items()]


def test_the_new_bugs_are_all_planted():
    assert set(EXERCISES["absorbed_decode"].bugs) == set(PLANTED) <= set(BUGS)
    assert_bugs_differ("absorbed_decode", PLANTED)


def test_reference_equals_attnlib_mla():
    """The exercise's reference is attnlib.mla's absorbed attention at one decode query."""
    from attnlib.mla import MLAWeights, absorbed_attention

    for case in EXERCISES["absorbed_decode"].cases():
        q_c, q_r, c, k_r, w_uk, w_uv, w_o, position = case.args
        h, d_c, nope = w_uk.shape
        w = MLAWeights(None, None, torch.zeros(1, h, 1), torch.zeros(1, d_c), None,
                       torch.zeros(1, k_r.shape[-1]), w_uk.double(), w_uv.double(),
                       w_o.double(), interleaved=False)  # fmt: skip
        q_turned = turn(q_r.double(), position)
        rows = torch.cat((c, k_r), -1).double()
        out = absorbed_attention(q_c.double()[:, :, None], q_turned[:, :, None], rows, w)
        want = EXERCISES["absorbed_decode"].reference(*case.args)
        assert (out[:, 0] - want).abs().max() < 1e-12


test_each_planted_bug_is_named = named_bug_test(PAIRS)
test_correct_answers_pass = correct_answers_test(CORRECT)
