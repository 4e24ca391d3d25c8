"""The exercise checker: every planted bug is named, correct answers pass, bad answers get words,
and every verdict says which cases ran, to what tolerance, and where the book explains a bug."""

import json
import linecache
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlib.lab.exercises as package
from attnlib.lab.exercises import BUGS, EXERCISES, Section, check
from attnlib.lab.exercises.core import _as_tuple, _close

REPO = Path(__file__).resolve().parent.parent

# ---- readers' answers, written the way a reader might -----------------------------------------


def causal_mask(t, s):
    """True where query i (the last t of s positions) may see key j."""
    return torch.ones(t, s, dtype=torch.bool).tril(s - t)


def attend(q, k, v, scale=None, mask=None):
    """Plain float32 attention with torch.softmax: a row that sees nothing gives NaN."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if mask is None:
        mask = causal_mask(q.shape[-2], k.shape[-2])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def causal_einsum(q, k, v):
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / q.shape[-1] ** 0.5
    t, s = scores.shape[-2:]
    scores = scores + torch.full((t, s), float("-inf")).triu(s - t + 1)
    return torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v)


def causal_loops(q, k, v):
    out = torch.zeros(*q.shape[:-1], v.shape[-1])
    t, s = q.shape[2], k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(t):
                n = s - t + i + 1  # the keys this query sees
                w = torch.softmax(k[b, h, :n] @ q[b, h, i] / math.sqrt(q.shape[-1]), 0)
                out[b, h, i] = w @ v[b, h, :n]
    return out


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_f64(q, k, v):
    return attend(q.double(), k.double(), v.double())


def decode_sdpa(q, k, v):  # the bottom-right mask, given explicitly
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[2], k.shape[2]))


def gqa_interleave(q, k, v):
    g = q.shape[1] // k.shape[1]
    return attend(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def gqa_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def gqa_index(q, k, v):
    heads = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    return causal_einsum(q, k[:, heads], v[:, heads])


def split_view(x, heads):
    b, t, f = x.shape
    return x.view(b, t, heads, f // heads).transpose(1, 2)


def split_loops(x, heads):
    dh = x.shape[-1] // heads
    return torch.stack([x[..., h * dh : (h + 1) * dh] for h in range(heads)], 1)


def split_unflatten(x, heads):
    return x.unflatten(-1, (heads, -1)).permute(0, 2, 1, 3).double()


def contributions_einsum(y, w_o):
    blocks = w_o.reshape(w_o.shape[0], y.shape[1], y.shape[3])  # [d_model, H, D]
    return torch.einsum("bhtd,mhd->bhtm", y, blocks)


def contributions_loop(y, w_o):
    d = y.shape[3]
    return torch.stack(
        [F.linear(y[:, h], w_o[:, h * d : (h + 1) * d]) for h in range(y.shape[1])], 1
    )


def angles(positions, d, pairs_per_feature):
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    a = positions.double()[:, None] * inv  # [T, D/2]
    return torch.cat([a, a], -1) if pairs_per_feature == "half" else a.repeat_interleave(2, -1)


def rope_half(x, positions):
    a = angles(positions, x.shape[-1], "half")
    x1, x2 = x.double().chunk(2, -1)
    return x.double() * a.cos() + torch.cat([-x2, x1], -1) * a.sin()


def rope_half_complex(x, positions):
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    z = z * torch.polar(
        torch.ones(1, dtype=torch.float64), angles(positions, d, "half")[:, : d // 2]
    )
    return torch.cat([z.real, z.imag], -1)


def rope_pairs(x, positions):
    a = angles(positions, x.shape[-1], "pairs")
    x = x.double()
    turned = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
    return x * a.cos() + turned * a.sin()


def rope_pairs_complex(x, positions):
    d = x.shape[-1]
    z = torch.view_as_complex(x.double().unflatten(-1, (d // 2, 2)).contiguous())
    z = z * torch.polar(torch.ones(1, dtype=torch.float64), angles(positions, d, "pairs")[:, ::2])
    return torch.view_as_real(z).flatten(-2)


def rope_attention(q, k, v, positions):
    return attend(rope_half(q, positions), rope_half(k, positions), v.double())


def rope_attention_sdpa(q, k, v, positions):
    q, k = rope_half_complex(q, positions).float(), rope_half_complex(k, positions).float()
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def kv_decode(q, k, v, k_cache, v_cache):
    return attend(q, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2))


def kv_decode_sdpa(q, k, v, k_cache, v_cache):
    return F.scaled_dot_product_attention(q, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2))


def online(scores, values, block, rescale_sum=True, rescale_out=True):
    """A reader's online softmax, with -inf guards; the flags plant the two bugs."""
    m = torch.full((scores.shape[0], 1), float("-inf"))
    ell, o = torch.zeros(scores.shape[0], 1), torch.zeros(scores.shape[0], values.shape[1])
    for j in range(0, scores.shape[1], block):
        s = scores[:, j : j + block]
        new_m = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = new_m.masked_fill(new_m == float("-inf"), 0.0)
        alpha, w = torch.exp(m - safe), torch.exp(s - safe)
        ell = (ell * alpha if rescale_sum else ell) + w.sum(-1, keepdim=True)
        o = (o * alpha if rescale_out else o) + w @ values[j : j + block]
        m = new_m
    return o / ell.clamp_min(1e-30)


def online_loops(scores, values, block):
    out = torch.zeros(scores.shape[0], values.shape[1], dtype=torch.float64)
    for i, row in enumerate(scores.double()):
        m, ell, o = -math.inf, 0.0, torch.zeros(values.shape[1], dtype=torch.float64)
        for j in range(0, len(row), block):
            s = row[j : j + block]
            new_m = max(m, float(s.max()))
            if new_m == -math.inf:
                continue
            alpha = math.exp(m - new_m)
            w = torch.exp(s - new_m)
            ell, o = ell * alpha + float(w.sum()), o * alpha + w @ values[j : j + block].double()
            m = new_m
        out[i] = o / ell if ell else o
    return out


def backward(q, k, v, dout, delta=True):
    scale, t = 1 / math.sqrt(q.shape[-1]), q.shape[2]
    p = torch.softmax((q @ k.transpose(-2, -1) * scale).masked_fill(~causal_mask(t, t), -1e30), -1)
    o = p @ v
    dp = dout @ v.transpose(-2, -1)
    ds = p * (dp - (dout * o).sum(-1, keepdim=True)) if delta else p * dp
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


def backward_autograd(q, k, v, dout):
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.autograd.grad(out, (q, k, v), dout.double())


def padded_mask(lengths, t):
    real = torch.arange(t)[None, :] >= (t - torch.tensor(lengths))[:, None]  # [B, T]
    return causal_mask(t, t) & real[:, None, None, :]  # [B, 1, T, T]


def padded(q, k, v, lengths):
    out = attend(q, k, v, mask=padded_mask(lengths, q.shape[2]))
    return out.nan_to_num(0.0)


def padded_sdpa(q, k, v, lengths):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=padded_mask(lengths, q.shape[2]))


# chapters 1-4, 10-13 and 17


def context_softmax(x):
    return torch.softmax(x @ x.T, dim=-1) @ x


def context_loops(x):
    rows = []
    for xi in x.double():
        e = [math.exp(float(xi @ xj)) for xj in x.double()]
        rows.append(sum(w / sum(e) * xj for w, xj in zip(e, x.double())))
    return torch.stack(rows)


def qkv_plain(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    return torch.softmax(q @ k.T / math.sqrt(k.shape[-1]), -1) @ v


def qkv_sdpa(x, w_q, w_k, w_v):
    return F.scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v)


def scores_matmul(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def scores_einsum(q, k):
    return torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * q.shape[-1] ** -0.5


def softmax_shifted(z):
    e = (z - z.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def softmax_logsumexp(z):
    return (z - z.logsumexp(-1, keepdim=True)).exp()


def jacobian_formula(a):
    return torch.diag(a) - torch.outer(a, a)


def jacobian_autograd(a):
    return torch.autograd.functional.jacobian(lambda z: torch.softmax(z, 0), a.double().log())


def cache_bytes_int(batch, layers, q_heads, kv_heads, head_dim, tokens, b):
    return 2 * batch * layers * kv_heads * head_dim * tokens * b


def cache_bytes_tensor(batch, layers, q_heads, kv_heads, head_dim, tokens, b):
    return torch.tensor([2, batch, layers, kv_heads, head_dim, tokens, b]).prod()


def loops_python(q, k, v):
    t, s, scale = q.shape[0], k.shape[0], 1 / math.sqrt(q.shape[1])
    out = torch.zeros(t, v.shape[1], dtype=torch.float64)
    for i in range(t):
        scores = [scale * float(q[i] @ k[j]) for j in range(s - t + i + 1)]
        m = max(scores)
        e = [math.exp(z - m) for z in scores]
        for j, w in enumerate(e):
            out[i] += w / sum(e) * v[j].double()
    return out


def loops_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[0], k.shape[0]))


def loops_no_max(q, k, v):  # float32 exp without the maximum: inf above 88
    e = (q @ k.T / q.shape[1] ** 0.5).exp().masked_fill(~causal_mask(q.shape[0], k.shape[0]), 0)
    return e / e.sum(-1, keepdim=True) @ v


def rmsnorm_rsqrt(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rmsnorm_torch(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def flops_loop(batch, heads, queries, keys, head_dim, causal):
    pairs = sum(keys - queries + i + 1 if causal else keys for i in range(queries))
    return 4 * pairs * head_dim * heads * batch


def flops_closed(batch, heads, queries, keys, head_dim, causal):
    pairs = queries * keys - (queries * (queries - 1) // 2 if causal else 0)
    return float(2 * pairs * 2 * head_dim * heads * batch)


def induction_loop(weights, offset):
    t = weights.shape[-1]
    picked = [weights[:, i, i - offset + 1] for i in range(offset, t - 1)]
    return torch.stack(picked, -1).mean(-1)


def induction_diagonal(weights, offset):
    line = torch.diagonal(weights, offset=1 - offset, dim1=-2, dim2=-1)  # i = o-1 .. T-1
    return line[:, 1:-1].mean(-1)


# chapters 19-22


def composition_formula(w_qk, w_ov):
    return float(
        torch.linalg.norm(w_qk @ w_ov) / (torch.linalg.norm(w_qk) * torch.linalg.norm(w_ov))
    )


def composition_einsum(w_qk, w_ov):
    product = torch.einsum("ij,jk->ik", w_qk.double(), w_ov.double())
    return (
        product.pow(2).sum().sqrt()
        / (w_qk.double().pow(2).sum() * w_ov.double().pow(2).sum()).sqrt()
    )


def merge_formula(out_a, lse_a, out_b, lse_b):
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = (lse_a - top).exp(), (lse_b - top).exp()
    total = wa + wb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (wa / safe)[..., None] * out_a + (wb / safe)[..., None] * out_b
    return out, torch.where(total > 0, top + safe.log(), torch.full_like(total, -math.inf))


def merge_logaddexp(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    finite = torch.isfinite(lse)[..., None]
    wa = torch.where(finite, (lse_a - lse)[..., None].exp(), torch.zeros(()))
    wb = torch.where(finite, (lse_b - lse)[..., None].exp(), torch.zeros(()))
    return wa * out_a.double() + wb * out_b.double(), lse


def ring_loop(q, k, v, processes):
    t = q.shape[2]
    size = t // processes
    out = lse = None
    for j0 in range(0, t, size):
        scores = q @ k[:, :, j0 : j0 + size].transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~causal_mask(t, t)[:, j0 : j0 + size], -math.inf)
        part_lse = scores.logsumexp(-1)
        part = torch.softmax(scores, -1).nan_to_num(0.0) @ v[:, :, j0 : j0 + size]
        out, lse = (part, part_lse) if out is None else merge_formula(out, lse, part, part_lse)
    return out


CORRECT = {
    "causal_attention": [causal_einsum, causal_loops, causal_sdpa, causal_f64],
    "split_heads": [split_view, split_loops, split_unflatten],
    "head_contributions": [contributions_einsum, contributions_loop],
    "decode_attention": [causal_einsum, causal_loops, decode_sdpa, causal_f64],
    "kv_cache_decode": [kv_decode, kv_decode_sdpa],
    "grouped_query_attention": [gqa_interleave, gqa_sdpa, gqa_index],
    "rope": [rope_half, rope_half_complex],
    "rope_interleaved": [rope_pairs, rope_pairs_complex],
    "rope_attention": [rope_attention, rope_attention_sdpa],
    "online_softmax": [online, online_loops],
    "attention_backward": [backward, backward_autograd],
    "padded_attention": [padded, padded_sdpa],
    "context_vectors": [context_softmax, context_loops],
    "qkv_attention": [qkv_plain, qkv_sdpa],
    "scaled_scores": [scores_matmul, scores_einsum],
    "stable_softmax": [softmax_shifted, softmax_logsumexp, lambda z: torch.softmax(z, -1)],
    "softmax_jacobian": [jacobian_formula, jacobian_autograd],
    "kv_cache_bytes": [cache_bytes_int, cache_bytes_tensor],
    "attention_loops": [loops_python, loops_sdpa],
    "qk_norm": [rmsnorm_rsqrt, rmsnorm_torch],
    "attention_flops": [flops_loop, flops_closed],
    "induction_score": [induction_loop, induction_diagonal],
    "composition_score": [composition_formula, composition_einsum],
    "merge_partials": [merge_formula, merge_logaddexp],
    "ring_attention_simulated": [ring_loop, lambda q, k, v, p: causal_sdpa(q, k, v)],
}


def hides_diagonal(q, k, v):
    t = q.shape[2]
    return attend(q, k, v, mask=torch.ones(t, t, dtype=torch.bool).tril(-1))  # NaN in row 0


def mask_after(q, k, v, renormalise):
    w = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) * causal_mask(
        q.shape[2], q.shape[2]
    )
    return (w / w.sum(-1, keepdim=True) if renormalise else w) @ v


def padded_nan(q, k, v, lengths):
    return attend(q, k, v, mask=padded_mask(lengths, q.shape[2]))


PLANTED = {  # bug -> (exercise, the reader's wrong answer)
    "scale_by_d": ("causal_attention", lambda q, k, v: attend(q, k, v, scale=1 / q.shape[-1])),
    "no_scale": ("causal_attention", lambda q, k, v: attend(q, k, v, scale=1.0)),
    "softmax_over_queries": (
        "causal_attention",
        lambda q, k, v: (
            (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5)
            .masked_fill(~causal_mask(q.shape[2], q.shape[2]), float("-inf"))
            .softmax(dim=-2)
            @ v
        ),
    ),
    "mask_after_softmax": ("causal_attention", lambda q, k, v: mask_after(q, k, v, False)),
    "mask_after_softmax_renormalised": (
        "causal_attention",
        lambda q, k, v: mask_after(q, k, v, True),
    ),
    "mask_inverted": (
        "causal_attention",
        lambda q, k, v: attend(q, k, v, mask=~causal_mask(q.shape[2], q.shape[2])),
    ),
    "mask_hides_diagonal": ("causal_attention", hides_diagonal),
    "reshape_without_transpose": (
        "split_heads",
        lambda x, h: x.reshape(x.shape[0], h, x.shape[1], -1),
    ),
    "transpose_wrong_axes": (
        "split_heads",
        lambda x, h: x.transpose(1, 2).reshape(x.shape[0], h, x.shape[1], -1),
    ),
    "head_features_strided": (
        "head_contributions",
        lambda y, w_o: torch.stack(
            [F.linear(y[:, h], w_o[:, h :: y.shape[1]]) for h in range(y.shape[1])], 1
        ),
    ),
    "w_o_cut_by_rows": (
        "head_contributions",
        lambda y, w_o: torch.stack(
            [y[:, h] @ w_o[h * y.shape[3] : (h + 1) * y.shape[3]] for h in range(y.shape[1])],
            1,
        ),
    ),
    "top_left_mask": ("decode_attention", causal_sdpa),
    "cache_not_read": ("kv_cache_decode", lambda q, k, v, kc, vc: attend(q, k, v)),
    "repeat_not_interleave": (
        "grouped_query_attention",
        lambda q, k, v: F.scaled_dot_product_attention(
            q,
            k.repeat(1, q.shape[1] // k.shape[1], 1, 1),
            v.repeat(1, q.shape[1] // k.shape[1], 1, 1),
            is_causal=True,
        ),
    ),
    "rope_interleaved_pairs": ("rope", rope_pairs),
    "rope_rotate_half_pairs": ("rope_interleaved", rope_half),
    "rope_positions_off_by_one": ("rope", lambda x, p: rope_half(x, p + 1)),
    "rope_on_v": (
        "rope_attention",
        lambda q, k, v, p: rope_attention(q, k, rope_half(v, p), p),
    ),
    "online_sum_not_rescaled": ("online_softmax", lambda s, v, b: online(s, v, b, False, True)),
    "online_output_not_rescaled": (
        "online_softmax",
        lambda s, v, b: online(s, v, b, True, False),
    ),
    "backward_without_delta": ("attention_backward", lambda *a: backward(*a, delta=False)),
    "pads_not_masked": ("padded_attention", lambda q, k, v, lengths: attend(q, k, v)),
    "masked_row_nan": ("padded_attention", padded_nan),
    "plain_sum_weights": ("context_vectors", lambda x: (x @ x.T) / (x @ x.T).sum(-1, True) @ x),
    "weights_over_columns": ("context_vectors", lambda x: torch.softmax(x @ x.T, 0) @ x),
    "keys_projected_by_w_q": ("qkv_attention", lambda x, wq, wk, wv: qkv_plain(x, wq, wq, wv)),
    "scale_by_value_width": (
        "qkv_attention",
        lambda x, wq, wk, wv: (
            qkv_plain(x, wq, wk, wv) * 0
            + F.scaled_dot_product_attention(
                x @ wq, x @ wk, x @ wv, scale=1 / math.sqrt(wv.shape[1])
            )
        ),
    ),
    "scale_by_key_count": (
        "scaled_scores",
        lambda q, k: q @ k.transpose(-2, -1) / k.shape[2] ** 0.5,
    ),
    "jacobian_diagonal_only": ("softmax_jacobian", lambda a: torch.diag(a - a * a)),
    "jacobian_sign_of_outer": ("softmax_jacobian", lambda a: torch.diag(a) + torch.outer(a, a)),
    "softmax_without_max": ("stable_softmax", lambda z: z.exp() / z.exp().sum(-1, keepdim=True)),
    "cache_bytes_with_query_heads": (
        "kv_cache_bytes",
        lambda b, n, hq, hkv, dh, s, nb: cache_bytes_int(b, n, hq, hq, dh, s, nb),
    ),
    "cache_bytes_keys_only": ("kv_cache_bytes", lambda *a: cache_bytes_int(*a) / 2),
    "rmsnorm_eps_outside_sqrt": (
        "qk_norm",
        lambda x, w, eps: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w,
    ),
    "rmsnorm_over_all_heads": (
        "qk_norm",
        lambda x, w, eps: (
            F.rms_norm(x.flatten(-2), (x.shape[-2] * x.shape[-1],), None, eps).unflatten(
                -1, x.shape[-2:]
            )
            * w
        ),
    ),
    "flops_one_product": ("attention_flops", lambda *a: flops_loop(*a) // 2),
    "flops_causal_half": (
        "attention_flops",
        lambda b, h, t, s, d, causal: 4 * t * s * d * h * b / (2 if causal else 1),
    ),
    "induction_same_token": (
        "induction_score",
        lambda w, o: torch.stack([w[:, i, i - o] for i in range(o, w.shape[-1] - 1)], -1).mean(-1),
    ),
    "induction_over_all_queries": (
        "induction_score",
        lambda w, o: torch.diagonal(w, offset=1 - o, dim1=-2, dim2=-1)[:, :-1].mean(-1),
    ),
}

PLANTED.update(
    {
        "composition_not_normalised": (
            "composition_score",
            lambda w_qk, w_ov: torch.linalg.norm(w_qk @ w_ov),
        ),
        "composition_order_swapped": (
            "composition_score",
            lambda w_qk, w_ov: composition_formula(w_ov, w_qk),
        ),
        "merge_plain_average": (
            "merge_partials",
            lambda oa, la, ob, lb: ((oa + ob) / 2, torch.logaddexp(la, lb)),
        ),
        "merge_without_max": ("merge_partials", lambda oa, la, ob, lb: merge_naive(oa, la, ob, lb)),
        "ring_partials_averaged": (
            "ring_attention_simulated",
            lambda q, k, v, p: ring_mean(q, k, v, p),
        ),
        "ring_empty_shard_nan": (
            "ring_attention_simulated",
            lambda q, k, v, p: ring_nan(q, k, v, p),
        ),
    }
)


def merge_naive(out_a, lse_a, out_b, lse_b):
    lse = (lse_a.exp() + lse_b.exp()).log()
    return (lse_a - lse).exp()[..., None] * out_a + (lse_b - lse).exp()[..., None] * out_b, lse


def ring_parts(q, k, v, processes):
    t, size = q.shape[2], q.shape[2] // processes
    for j0 in range(0, t, size):
        scores = q @ k[:, :, j0 : j0 + size].transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~causal_mask(t, t)[:, j0 : j0 + size], -math.inf)
        yield torch.softmax(scores, -1), scores.logsumexp(-1), v[:, :, j0 : j0 + size]


def ring_mean(q, k, v, processes):
    parts = [
        (w.nan_to_num(0.0) @ vs, torch.isfinite(lse))
        for w, lse, vs in ring_parts(q, k, v, processes)
    ]
    return sum(o for o, _ in parts) / sum(s.float() for _, s in parts)[..., None]


def ring_nan(q, k, v, processes):
    out = lse = None
    for w, part_lse, vs in ring_parts(q, k, v, processes):
        part = w @ vs  # NaN where the shard is all in the future
        out, lse = (part, part_lse) if out is None else merge_formula(out, lse, part, part_lse)
    return out


# A bug that two exercises share is planted in the second one here.
PLANTED_ALSO = [
    ("scale_by_d", "scaled_scores", lambda q, k: q @ k.transpose(-2, -1) / q.shape[-1]),
    ("no_scale", "scaled_scores", lambda q, k: q @ k.transpose(-2, -1)),
    (
        "top_left_mask",
        "attention_loops",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    ),
    ("softmax_without_max", "attention_loops", lambda q, k, v: loops_no_max(q, k, v)),
]
PAIRS = [(bug, ex, fn) for bug, (ex, fn) in PLANTED.items()] + PLANTED_ALSO

TIMES = {}

# ---- each bug is caught and named -------------------------------------------------------------


def planted_everywhere() -> list:
    """(bug, exercise) for every wrong answer planted here and in tests/test_exercises_part*.py,
    where a chapter's new exercises plant theirs (as bug -> (exercise, fn), or bug -> fn when
    one exercise lists the bug, plus PLANTED_ALSO)."""
    import importlib

    pairs = [(bug, ex) for bug, ex, _ in PAIRS]
    for path in sorted(Path(__file__).parent.glob("test_exercises_*.py")):
        module = importlib.import_module(f"tests.{path.stem}")
        for bug, entry in getattr(module, "PLANTED", {}).items():
            if isinstance(entry, tuple):
                pairs.append((bug, entry[0]))
            else:
                (only,) = [name for name, ex in EXERCISES.items() if bug in ex.bugs]
                pairs.append((bug, only))
        pairs += [(bug, ex) for bug, ex, _ in getattr(module, "PLANTED_ALSO", [])]
    return pairs


def test_every_bug_is_planted_and_listed():
    pairs = planted_everywhere()
    assert {bug for bug, _ in pairs} == set(BUGS)
    listed = [(bug, name) for name, ex in EXERCISES.items() for bug in ex.bugs]
    assert sorted(listed) == sorted(pairs)


def assert_one_verdict(printed: str, exercise: str):
    """One verdict, wrapped at the page's 80 columns: its first line names the exercise, the
    lines after it are indented continuations, and no traceback."""
    lines = printed.splitlines()
    assert lines[0].startswith(f"{exercise}: ") and "Traceback" not in printed
    assert all(line.startswith("  ") for line in lines[1:])
    assert all(len(line) <= 80 for line in lines), lines


def named_bug_test(pairs):
    """The test that each planted wrong answer, (bug, exercise, fn) in `pairs`, is caught and
    named with its section in one verdict; every file that plants bugs collects its own."""

    @pytest.mark.parametrize("bug, exercise, wrong", pairs, ids=[f"{b}-{e}" for b, e, _ in pairs])
    def test(bug, exercise, wrong, capsys):
        result = check(exercise, wrong)
        line = capsys.readouterr().out
        assert not result.passed
        assert result.diagnosis == bug, result.message
        assert result.section == BUGS[bug].section
        assert f"`{bug}`" in result.message and f"See {BUGS[bug].section}." in result.message
        assert_one_verdict(line, exercise)
        assert line.rstrip("\n") == result.text

    return test


def correct_answers_test(correct):
    """The test that every right answer in `correct` (exercise -> functions) passes, undiagnosed."""
    pairs = [(name, fn) for name, fns in correct.items() for fn in fns]

    @pytest.mark.parametrize("name, fn", pairs, ids=[f"{n}-{f.__name__}" for n, f in pairs])
    def test(name, fn):
        result = check(name, fn)
        assert result.passed and result.diagnosis is None, result.message

    return test


test_each_planted_bug_is_named = named_bug_test(PAIRS)


def test_no_two_bugs_look_alike():
    """On an exercise's cases each wrong version of the bank reproduces itself and nothing else."""
    for ex in EXERCISES.values():
        cases = ex.cases()
        for bug in ex.bugs:
            outs = [_as_tuple(ex.bugs[bug](*c.args)) for c in cases]
            assert not all(
                _close(o, _as_tuple(ex.reference(*c.args))) for c, o in zip(cases, outs)
            ), bug
            alike = [
                other
                for other, wrong in ex.bugs.items()
                if all(_close(o, _as_tuple(wrong(*c.args)), True) for c, o in zip(cases, outs))
            ]
            assert alike == [bug]


def assert_bugs_differ(name: str, planted) -> None:
    """Exercise `name`'s wrong versions are exactly the bugs planted for it, and each differs
    from the reference and from the others on its cases even with NaN read as 0 (stricter than
    test_no_two_bugs_look_alike, which lets masked_row_nan differ only by its NaNs). Used by the
    test files of the chapters' new exercises."""
    ex = EXERCISES[name]
    cases = ex.cases()
    refs = [_as_tuple(ex.reference(*c.args)) for c in cases]
    outs = {bug: [_as_tuple(f(*c.args)) for c in cases] for bug, f in ex.bugs.items()}
    assert set(outs) == set(planted), set(outs) ^ set(planted)
    for bug, got in outs.items():
        assert not all(_close(g, r, True) for g, r in zip(got, refs)), f"{bug} is the reference"
    for a in outs:
        for b in outs:
            if a < b:
                same = all(_close(x, y, True) for x, y in zip(outs[a], outs[b]))
                assert not same, f"{a} and {b} give the same outputs on every case"


# ---- no false diagnosis: correct answers in many styles, over random shapes -------------------


def gen_args(name, seed, b, h, g, t, extra, d):
    """Arguments for exercise `name` drawn from the given sizes; g: query heads per KV head."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    if name == "split_heads":
        return randn(b, t, h * d), h
    if name == "head_contributions":
        return randn(b, h * g, t, d), randn(h * g * d, h * g * d)
    if name in ("causal_attention", "attention_backward"):
        return tuple(randn(b, h, t, d) for _ in range(4 if name == "attention_backward" else 3))
    if name == "decode_attention":
        return randn(b, h, t, d), randn(b, h, t + extra, d), randn(b, h, t + extra, d)
    if name == "kv_cache_decode":
        return (*(randn(b, h, 1, d) for _ in range(3)), *(randn(b, h, extra + 1, d) for _ in "kv"))
    if name == "grouped_query_attention":
        return randn(b, h * g, t, d), randn(b, h, t, d), randn(b, h, t, d)
    positions = torch.arange(extra, extra + t)
    if name in ("rope", "rope_interleaved"):
        return randn(b, h, t, 2 * d), positions
    if name == "rope_attention":
        return (*(randn(b, h, t, 2 * d) for _ in range(3)), positions)
    if name == "online_softmax":
        return randn(t, t + extra) * 3, randn(t + extra, d), g
    if name == "padded_attention":
        lengths = torch.randint(0, t + 1, (b,), generator=gen).tolist()
        return (*(randn(b, h, t, d) for _ in range(3)), lengths)
    return gen_args_more(name, randn, b, h, g, t, extra, d)


def gen_args_more(name, randn, b, h, g, t, extra, d):
    """The arguments of the exercises of chapters 1-4, 10-13 and 17."""
    if name == "context_vectors":
        return (randn(t, d),)
    if name == "qkv_attention":
        return randn(t, d), randn(d, g), randn(d, g), randn(d, h)
    if name == "scaled_scores":
        return randn(b, h, t, d), randn(b, h, t + extra, d)
    if name == "stable_softmax":
        return (randn(b, t) * 10**g,)  # scores up to about 1000
    if name == "softmax_jacobian":
        return (torch.softmax(randn(t), 0),)
    if name == "kv_cache_bytes":
        return b, t, h * g, h, d, extra + 1, [1, 2, 4, 8][g]
    if name == "attention_loops":
        return randn(t, d), randn(t + extra, d), randn(t + extra, h)
    if name == "qk_norm":
        return randn(b, t, h, d), randn(d), 10.0**-g
    if name == "attention_flops":
        return b, h, t, t + extra, d, bool(g % 2)
    if name == "induction_score":
        offset = extra + 1
        scores = randn(h, offset + t + 1, offset + t + 1)
        return torch.softmax(
            scores.masked_fill(~causal_mask(*scores.shape[1:]), -math.inf), -1
        ), offset
    return gen_args_last(name, randn, b, h, g, t, extra, d)


def gen_args_last(name, randn, b, h, g, t, extra, d):
    """The arguments of the exercises of chapters 19-22."""
    if name == "composition_score":
        return randn(d, d), randn(d, d) * g
    if name == "merge_partials":
        lse_b = randn(b, h, t) * 3
        lse_b[..., : extra % (t + 1)] = -math.inf  # a part in which early queries saw nothing
        return randn(b, h, t, d), randn(b, h, t) * 3, randn(b, h, t, d), lse_b
    if name == "ring_attention_simulated":
        return randn(b, h, t * g, d), randn(b, h, t * g, d), randn(b, h, t * g, d), g
    raise AssertionError(name)


shapes = st.tuples(
    st.integers(0, 2**16),
    st.integers(1, 3),  # B
    st.integers(1, 3),  # H (KV heads)
    st.integers(1, 3),  # query heads per KV head; the block of the online softmax
    st.integers(1, 7),  # T
    st.integers(0, 5),  # extra keys, or the first position
    st.integers(1, 8),  # D (half of it for RoPE)
)


@pytest.mark.parametrize("name", sorted(CORRECT))
@settings(max_examples=5, deadline=None)
@given(sizes=shapes)
def test_correct_answers_pass_without_diagnosis(name, sizes):
    args = gen_args(name, *sizes)
    for fn in CORRECT[name]:
        result = check(name, fn, extra=[args])
        assert result.passed and result.diagnosis is None, (fn.__name__, result.message)


def test_seeded_cases_pass_every_style():
    for name, fns in CORRECT.items():
        for fn in fns:
            start = time.perf_counter()
            result = check(name, fn)
            TIMES.setdefault(name, time.perf_counter() - start)
            assert result.passed and result.diagnosis is None, (name, fn.__name__, result.message)


# ---- malformed answers get words, never a traceback -------------------------------------------


def raises(q, k, v):
    raise RuntimeError("shapes do not match")


def not_implemented(q, k, v):
    raise NotImplementedError


def in_place(q, k, v):
    q /= q.shape[-1] ** 0.5
    return attend(q, k, v, scale=1.0)


def with_nan(q, k, v):
    out = attend(q, k, v).clone()
    out[..., -1, 1] = float("nan")
    return out


def leaks(q, k, v):  # no mask at all: future keys get weight
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) @ v


def half_weights(q, k, v):  # rows sum to 0.5
    return attend(q, k, v) / 2


@pytest.mark.parametrize(
    "fn, words",
    [
        (
            raises,
            f"at line {raises.__code__.co_firstlineno + 1}, "
            '`raise RuntimeError("shapes do not match")`: shapes do not match',
        ),
        (not_implemented, "Not implemented yet"),
        (lambda q, k, v: q.transpose(1, 2), "has shape"),
        (lambda q, k, v: q[..., :1], "has shape"),
        (lambda q, k, v: attend(q, k, v).tolist(), "Expected a torch.Tensor"),
        (lambda q, k, v: None, "got NoneType"),
        (lambda q, k, v: (q, k), "got tuple"),
        (lambda q, k, v: q.long(), "floating-point"),
        (in_place, "changed its input `q` in place"),
        (with_nan, "has NaN, first at out[0, 0, 4, 1]"),
        (leaks, "which it must not see"),
        (half_weights, "sum to 0.5, not 1"),
        (lambda q, k, v: attend(q, k, v) + 0.01, "first wrong entry out[0, 0, 0, 0] = "),
        ("not a function", "Expected a function"),
    ],
)
def test_malformed_answers_get_a_message(fn, words, capsys):
    result = check("causal_attention", fn)
    out = capsys.readouterr().out
    assert not result.passed and result.diagnosis is None
    assert words in result.message, result.message
    assert_one_verdict(out, "causal_attention")


def test_malformed_tuple_answers():
    result = check("attention_backward", lambda q, k, v, d: (q, k))
    assert "Expected a tuple of 3 tensors" in result.message
    result = check("attention_backward", lambda q, k, v, d: (q, k, v[..., :2]))
    assert "dv has shape" in result.message


def test_stubs_say_not_implemented():
    def stub(*args):
        raise NotImplementedError("write this")

    for name in EXERCISES:
        result = check(name, stub)
        assert not result.passed and "Not implemented yet" in result.message
        assert "\n  Cases it will run: " in result.text and "\n  Tolerance: " in result.text


def test_timings_under_two_seconds():
    for name, fns in CORRECT.items():
        start = time.perf_counter()
        check(name, fns[0])
        TIMES[name] = time.perf_counter() - start
    print("\ncheck time per exercise:")
    for name, seconds in TIMES.items():
        print(f"  {name:26s} {seconds * 1000:7.1f} ms")


def test_import_is_light():
    code = (
        "import sys, attnlib.lab.exercises; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'matplotlib')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- the verdict: cases, tolerance, the failing case, the reader's line ----------------------


def dtype_mismatch(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1)
    return weights.double() @ v


def unwrapped(text: str) -> str:
    """The verdict's lines joined again, as the reader's eye does."""
    return " ".join(line.strip() for line in text.splitlines())


def test_an_exception_names_the_readers_line(capsys):
    result = check("causal_attention", dtype_mismatch)
    printed = capsys.readouterr().out
    line = dtype_mismatch.__code__.co_firstlineno + 2
    assert not result.passed and result.diagnosis is None
    assert "\n" not in result.message and "Traceback" not in printed
    assert result.message.startswith(
        f"Your function raised RuntimeError at line {line}, `return weights.double() @ v`: "
    ), result.message
    assert "dtype" in result.message or "Double" in result.message  # torch's own words
    assert result.message.endswith("(case 1 of 5: B=2, H=3, T=5, D=8).")
    assert_one_verdict(printed, "causal_attention")
    assert result.message in unwrapped(printed)


def test_an_exception_in_a_notebook_cell_names_the_cells_line():
    """In Jupyter a cell is a file like /tmp/ipykernel_1/2.py that only linecache can read."""
    filename = "/tmp/ipykernel_4242/123456.py"
    code = "import torch\n\n\ndef mine(q, k, v):\n    return q @ k.mT.double()\n"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        namespace = {}
        exec(compile(code, filename, "exec"), namespace)
        result = check("causal_attention", namespace["mine"])
    finally:
        del linecache.cache[filename]
    assert "raised RuntimeError at line 5, `return q @ k.mT.double()`: " in result.message


def test_an_exception_without_the_readers_code_leaves_the_line_out():
    result = check("causal_attention", torch.matmul)  # three tensors for two arguments
    assert result.message.startswith("Your function raised TypeError: "), result.message
    assert " at line " not in result.message


def test_every_verdict_names_the_cases_and_the_tolerance(capsys):
    labels = [c.label for c in EXERCISES["causal_attention"].cases()]
    stub = check("causal_attention", not_implemented)
    passed = check("causal_attention", causal_sdpa)
    failed = check("causal_attention", PLANTED["mask_after_softmax"][1])
    capsys.readouterr()
    tolerance = "Tolerance: rtol 1e-3, atol 1e-4, against a float64 reference."
    for result, cases in [(stub, "Cases it will run: "), (passed, "Cases: "), (failed, "Cases: ")]:
        parts = result.text.split("\n  ")  # continuation lines of one part follow its first
        assert any(p.startswith(cases) for p in parts), result.text
        assert unwrapped(result.text).endswith(f"{cases}{'; '.join(labels)}. {tolerance}")
    assert passed.text.startswith("causal_attention: passed. Correct on all 5 cases.")
    assert stub.text.startswith("causal_attention: not yet. Not implemented yet")
    first = re.search(
        r"First failing case: 1 of 5 \(B=2, H=3, T=5, D=8\); largest difference (\d\S*); "
        r"first wrong entry out\[0, 0, 0, 0\] = (\S+), expected (\S+)\.",
        unwrapped(failed.text),
    )
    assert first, failed.text
    assert first.group(1) in failed.message
    assert 0 < float(first.group(1).rstrip(";")) < 10


def test_many_cases_are_listed_by_the_first_five():
    result = check(
        "causal_attention", causal_sdpa, extra=[EXERCISES["causal_attention"].cases()[0].args] * 3
    )
    assert "; and 3 more." in unwrapped(result.text), result.text
    assert "extra 0" not in result.text


def test_the_largest_difference_and_the_wrong_entry_are_exact():
    def off(q, k, v):
        out = attend(q, k, v).clone()
        out[..., -1, -1] += 0.25  # every head's last query, last feature
        return out

    result = check("causal_attention", off)
    assert "largest difference 0.25; first wrong entry out[0, 0, 4, 7] = " in result.message


# ---- sections: each bug points to a heading of the book, never to its own exercise -----------


def walk(chapter: str):
    """A notebook in order: ("heading", level, number or None, title, MyST's slug) for each
    heading down to ### (none inside ``` fences), ("code", source) for each code cell."""
    from myst_parser.mdit_to_docutils.base import default_slugify

    cells = json.loads((REPO / "notebooks" / f"{chapter}.ipynb").read_text())["cells"]
    n, k, m = int(chapter.split("_")[0]), 0, 0
    slugs = set()
    for cell in cells:
        if cell["cell_type"] == "code":
            yield "code", "".join(cell["source"])
        if cell["cell_type"] != "markdown":
            continue
        fence = None
        for line in "".join(cell["source"]).splitlines():
            marker = re.match(r"\s*(```|~~~)", line)
            if marker:
                fence = None if fence == marker.group(1) else fence or marker.group(1)
                continue
            heading = re.match(r"(#{1,3}) (.+?)\s*$", line)
            if fence or not heading:
                continue
            level, title = len(heading.group(1)), heading.group(2)
            if level == 2:
                k, m = k + 1, 0
            elif level == 3:
                m += 1
            number = None if level == 1 else f"{n}.{k}" if level == 2 else f"{n}.{k}.{m}"
            slug = default_slugify(re.sub(r"\$[^$]*\$", "", title).replace("`", ""))
            i = 1
            while slug in slugs:  # MyST's compute_unique_slug
                slug, i = f"{slug}-{i}", i + 1
            slugs.add(slug)
            yield "heading", level, number, title, slug


def notebook_headings(chapter: str) -> list:
    """(level, number or None, title, MyST's slug) of the headings of a notebook's markdown."""
    return [item[1:] for item in walk(chapter) if item[0] == "heading"]


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_every_section_is_a_heading_of_its_notebook(bug):
    section = BUGS[bug].section
    headings = notebook_headings(section.chapter)
    titles = {number: (title, slug) for _, number, title, slug in headings if number}
    assert section.number in titles, f"{bug}: no heading {section.number} in {section.chapter}"
    title, slug = titles[section.number]
    assert section.title == title, f"{bug}: §{section.number} is {title!r}"
    assert section.slug == slug  # MyST's, with its -1 where the slug was taken before
    assert section.url == f"{package.BOOK_URL}notebooks/{section.chapter}.html#{slug}"


def test_slugs_follow_myst():
    assert Section(
        "07_positions", "7.7", "The `is_causal` pitfall: SDPA's top-left triangle"
    ).slug == ("the-is_causal-pitfall-sdpas-top-left-triangle")
    section = Section("05_causal_masking", "5.6", r"$-\infty$ or a large negative number?")
    assert section.slug == "-or-a-large-negative-number"
    assert str(section) == r"§5.6, $-\infty$ or a large negative number?"
    assert Section("x", "1.1", "Measured", repeat=2).slug == "measured-1-2"  # MyST's way


def exercise_sections() -> dict:
    """Exercise name -> the Section of the `### Exercise` heading whose stub cell checks it."""
    found = {}
    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        current = None
        for item in walk(path.stem):
            if item[0] == "heading":
                level, number, title = item[1:4]
                exercise = level == 3 and title.startswith("Exercise ")
                current = Section(path.stem, number, title) if exercise else None
            elif "NotImplementedError" in item[1] and current:
                for name in re.findall(r'check\("(\w+)"', item[1]):
                    found.setdefault(name, current)
    return found


def test_no_bug_points_to_its_own_exercise():
    own = exercise_sections()  # (a checked name the bank lacks is test_exercise_index's concern)
    assert set(EXERCISES) <= set(own), set(EXERCISES) - set(own)
    for name, ex in EXERCISES.items():
        for bug in ex.bugs:
            section = BUGS[bug].section
            assert (section.chapter, section.number) != (own[name].chapter, own[name].number), (
                f"{bug} sends the reader of {name} to its own exercise, {own[name]}"
            )


def test_jupyter_shows_the_section_as_a_link(monkeypatch, capsys):
    IPython = pytest.importorskip("IPython")
    display = pytest.importorskip("IPython.display")

    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setattr(display, "display", lambda *a, **kw: shown.append((a, kw)))
    result = check("causal_attention", PLANTED["mask_after_softmax"][1])
    assert capsys.readouterr().out == ""
    [((bundle,), kwargs)] = shown
    assert kwargs == {"raw": True} and bundle["text/plain"] == result.text
    section = BUGS["mask_after_softmax"].section
    link = (
        '<a href="https://attention-first-principles.github.io/attention-book/notebooks/'
        f'05_causal_masking.html#{section.slug}" target="_blank">{section}</a>'
    )
    assert link in bundle["text/html"]
    assert "<code>mask_after_softmax</code>" in bundle["text/html"]
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)  # a plain console: print
    check("causal_attention", causal_sdpa)
    assert capsys.readouterr().out.startswith("causal_attention: passed.") and len(shown) == 1


# ---- the package: one chapter, one module ----------------------------------------------------


def test_modules_are_small_and_each_exercise_lives_in_one():
    folder = Path(package.__file__).parent
    for path in folder.glob("*.py"):
        assert len(path.read_text().splitlines()) < 500, path.name
    names = [m.__name__.rsplit(".", 1)[1] for m in package.CHAPTERS]
    assert names == sorted(p.stem for p in folder.glob("ch[0-9][0-9].py"))
    for name, module in zip(names, package.CHAPTERS):  # ch05 is 05_causal_masking's
        assert module.CHAPTER.startswith(name[2:] + "_")
        assert (REPO / "notebooks" / f"{module.CHAPTER}.ipynb").exists()
    for module in package.CHAPTERS:
        borrowed = getattr(module, "BORROWED", {})
        for name, bug in borrowed.items():
            assert BUGS[name] is bug and name not in module.BUGS  # defined once, elsewhere
        for name, ex in module.EXERCISES.items():
            parts = [ex.cases, ex.reference, *ex.bugs.values()] + [ex.probe] * bool(ex.probe)
            for fn in parts:
                home = getattr(fn, "__module__", None) == module.__name__
                assert home or any(fn is v for v in vars(module).values()), (name, fn)
            assert set(ex.bugs) <= set(module.BUGS) | set(borrowed), name


def test_the_registry_rejects_a_name_defined_twice():
    chapter = package.CHAPTERS[0]
    with pytest.raises(ValueError, match="defined twice"):
        package.register([chapter, chapter])
    twin = SimpleNamespace(__name__="twin", BUGS={}, EXERCISES=dict(chapter.EXERCISES))
    with pytest.raises(ValueError, match="exercise 'context_vectors' is defined twice"):
        package.register([chapter, twin])
    stray = SimpleNamespace(__name__="stray", BUGS={}, EXERCISES=dict(chapter.EXERCISES))
    with pytest.raises(ValueError, match="unknown bugs"):
        package.register([stray])
    assert package.register(package.CHAPTERS) == (EXERCISES, BUGS)
