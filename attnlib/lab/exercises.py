"""The book's exercises and their checker, which names the bug it recognises (torch only).

`check(name, fn)` runs the reader's `fn` and the reference on a few seeded cases, prints one
verdict line and returns a `Result`. Where the answer is wrong, it is run against every known
wrong version of the exercise (the bank `BUGS`); a bug is named only when it reproduces the
reader's output, to tolerance, on every case. `EXERCISES` lists the exercises and signatures.
"""

import math
import textwrap
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ..attention import causal_attention
from ..cost import attention_flops
from ..heads import split_heads
from ..masks import left_padding
from ..merge import merge_attention
from ..rope import apply_rope, rope_cos_sin
from ..softmax import softmax
from .decode import kv_cache_bytes

RTOL, ATOL = 1e-3, 1e-4  # float32 answers against float64 references
SECTION = "../notebooks/{}.ipynb#{}"  # a chapter and the label of the section


class Bug(NamedTuple):
    """One known mistake: what goes wrong, and the chapter that demonstrates it."""

    explanation: str
    link: str


@dataclass(frozen=True)
class Result:
    """The verdict of `check`: passed, the name of the recognised bug (a key of BUGS), the text."""

    passed: bool
    diagnosis: Optional[str]
    message: str


class Case(NamedTuple):
    """The arguments of one call of the reader's function, and a label for messages."""

    args: tuple
    label: str


def _link(chapter: str, label: str) -> str:
    return SECTION.format(chapter, label)


BUGS = {
    "scale_by_d": Bug(
        "The scores are divided by D instead of sqrt(D); the logits shrink as D grows and the "
        "softmax flattens towards uniform.",
        _link("03_scaling", "why-sqrt-d"),
    ),
    "no_scale": Bug(
        "The scores are never multiplied by 1/sqrt(D); their spread grows like sqrt(D) and the "
        "softmax saturates.",
        _link("03_scaling", "why-sqrt-d"),
    ),
    "softmax_over_queries": Bug(
        "The softmax runs over the queries (dim=-2) instead of the keys (dim=-1), so columns sum "
        "to 1 and each query's weights do not.",
        _link("05_causal_masking", "exercise-5-3"),
    ),
    "mask_after_softmax": Bug(
        "The future is zeroed after the softmax, so the rows no longer sum to 1 and the future "
        "still sets the denominator; mask with -inf before the softmax.",
        _link("05_causal_masking", "mask-after-softmax"),
    ),
    "mask_after_softmax_renormalised": Bug(
        "Zeroing after the softmax and renormalising is exact on paper, but the softmax saw the "
        "future keys: when a future score dominates, the allowed weights underflow to 0 and the "
        "row becomes 0/0 = NaN. Mask with -inf before the softmax.",
        _link("05_causal_masking", "mask-after-softmax"),
    ),
    "mask_inverted": Bug(
        "The mask's polarity is inverted: each query sees only its future keys (and the last "
        "query sees nothing). masked_fill fills where the mask is True, so pass ~allowed.",
        _link("05_causal_masking", "mask-on-the-scores"),
    ),
    "mask_hides_diagonal": Bug(
        "The mask is off by one and hides the diagonal: key j is visible only when j < i, so a "
        "query cannot see itself and the first query sees nothing. The -inf belong strictly "
        "above the diagonal: triu(..., diagonal=1).",
        _link("05_causal_masking", "mask-on-the-scores"),
    ),
    "reshape_without_transpose": Bug(
        "x.reshape(B, H, T, Dh) has the right shape and the wrong data: it mixes tokens into "
        "heads. Reshape to [B, T, H, Dh], then transpose(1, 2).",
        _link("06_multi_head", "transpose-trap"),
    ),
    "transpose_wrong_axes": Bug(
        "x.transpose(1, 2) swaps tokens with features before the split, which scrambles both. "
        "Split the features first, [B, T, H, Dh], then swap T and H.",
        _link("06_multi_head", "transpose-trap"),
    ),
    "top_left_mask": Bug(
        "The mask is aligned top-left (key j visible to query i when j <= i), as SDPA's "
        "is_causal does; with T < S the new queries are the last T positions, so j <= S-T+i.",
        _link("07_positions", "is-causal-top-left"),
    ),
    "cache_not_read": Bug(
        "The new query attends only to the new key and ignores the cache, so its output is just "
        "the new value; concatenate the cached keys and values first.",
        _link("07_positions", "cached-decoding"),
    ),
    "repeat_not_interleave": Bug(
        "k.repeat(1, g, 1, 1) tiles the KV heads (0, 1, 0, 1); query head h needs KV head h // g, "
        "which repeat_interleave(g, dim=1) gives (0, 0, 1, 1).",
        _link("09_grouped_query", "repeat-kv"),
    ),
    "rope_interleaved_pairs": Bug(
        "Features (2i, 2i+1) were rotated together, the interleaved layout; rotate-half pairs "
        "feature i with feature i + D/2.",
        _link("08_rotary_positions", "rotate-half"),
    ),
    "rope_rotate_half_pairs": Bug(
        "Feature i was paired with feature i + D/2, the rotate-half layout; the interleaved "
        "layout rotates the neighbours (2i, 2i+1).",
        _link("08_rotary_positions", "rotate-half"),
    ),
    "rope_positions_off_by_one": Bug(
        "Every token is rotated by the angle of the next position: positions + 1 instead of the "
        "positions given (the first token is not rotated at all).",
        _link("08_rotary_positions", "rope-and-positions"),
    ),
    "rope_on_v": Bug(
        "RoPE was applied to the values too; it belongs on queries and keys only, where it makes "
        "the scores depend on relative position.",
        _link("08_rotary_positions", "exercise-8-4"),
    ),
    "online_sum_not_rescaled": Bug(
        "When the running maximum grows, the running sum l must be multiplied by exp(m - m') "
        "like the output accumulator; here it is not.",
        _link("14_tiling", "online-softmax-by-blocks"),
    ),
    "online_output_not_rescaled": Bug(
        "When the running maximum grows, the output accumulator o must be multiplied by "
        "exp(m - m') like the running sum; here it is not.",
        _link("14_tiling", "online-softmax-by-blocks"),
    ),
    "backward_without_delta": Bug(
        "dZ = P * (dP - delta) needs the row-sum term delta_i = dO_i . O_i; without it dq and dk "
        "are wrong (dv is right).",
        _link("15_backward", "backward-derived"),
    ),
    "pads_not_masked": Bug(
        "The pads are not masked: real tokens attend to the pad slots before them. Combine the "
        "causal rule with a key mask that hides the pads.",
        _link("07_positions", "padded-batches"),
    ),
    "masked_row_nan": Bug(
        "A query that sees no key (a pad) gives NaN: softmax over a row of -inf is 0/0. Such a "
        "row must output zeros.",
        _link("05_causal_masking", "fully-masked-softmax"),
    ),
    "plain_sum_weights": Bug(
        "The scores were divided by their sum instead of passed through the softmax: negative "
        "scores give negative weights, and a row whose scores sum to nearly 0 explodes.",
        _link("01_context", "plain-sum"),
    ),
    "weights_over_columns": Bug(
        "The softmax ran down the columns (dim=0), so each key's weights sum to 1 and each "
        "token's do not; normalise along each row, over the tokens a token looks at.",
        _link("01_context", "every-token-at-once"),
    ),
    "keys_projected_by_w_q": Bug(
        "The keys were made with W_Q, so the scores are q_i . q_j: symmetric again, as without "
        "projections; keys need their own matrix W_K.",
        _link("02_queries_keys_values", "plain-dot-products"),
    ),
    "scale_by_value_width": Bug(
        "The scores were divided by sqrt(d_v), the width of the values; the dot products are "
        "d_k wide, so the scale is 1/sqrt(d_k).",
        _link("03_scaling", "dot-product-size"),
    ),
    "scale_by_key_count": Bug(
        "The scores were divided by sqrt(S), the number of keys; the variance of a dot product "
        "grows with its width D, so the scale is 1/sqrt(D).",
        _link("03_scaling", "dot-product-size"),
    ),
    "jacobian_diagonal_only": Bug(
        "Only the diagonal a_i (1 - a_i) is there: every weight depends on every score, so the "
        "off-diagonal entries -a_i a_j belong too.",
        _link("04_softmax_jacobian", "softmax-jacobian"),
    ),
    "jacobian_sign_of_outer": Bug(
        "The outer product was added: the Jacobian is diag(a) - a a^T, and with the + its rows "
        "no longer sum to 0.",
        _link("04_softmax_jacobian", "softmax-jacobian"),
    ),
    "softmax_without_max": Bug(
        "exp(z) overflows for scores above about 88 in float32 (709 in float64) and inf/inf is "
        "NaN; subtract each row's maximum before exp.",
        _link("04_softmax_jacobian", "stable-softmax"),
    ),
    "cache_bytes_with_query_heads": Bug(
        "The count used the query heads H_q; the cache holds keys and values of the H_kv "
        "key/value heads only.",
        _link("10_decoding", "what-the-cache-holds"),
    ),
    "cache_bytes_keys_only": Bug(
        "Only the keys were counted; every token leaves a key and a value, hence the factor 2.",
        _link("10_decoding", "what-the-cache-holds"),
    ),
    "rmsnorm_eps_outside_sqrt": Bug(
        "The epsilon was added after the square root: RMSNorm divides by sqrt(mean(x^2) + eps), "
        "with eps inside.",
        _link("12_qwen3_lab", "the-manual-pass-step-by-step"),
    ),
    "rmsnorm_over_all_heads": Bug(
        "The mean of squares ran over all the heads' features (H * D); Qwen3's q_norm and k_norm "
        "normalise each head's D features on their own.",
        _link("12_qwen3_lab", "the-manual-pass-step-by-step"),
    ),
    "flops_one_product": Bug(
        "Only the scores Q K^T were counted; the output A V is a second product of the same "
        "size, 2 T S D_v more.",
        _link("13_cost", "counting-the-flops"),
    ),
    "flops_causal_half": Bug(
        "The causal count took half the pairs, T S / 2; query i sees S - T + i + 1 keys, so the "
        "visible pairs number T S - T (T - 1) / 2.",
        _link("13_cost", "counting-the-flops"),
    ),
    "induction_same_token": Bug(
        "This is the weight on the earlier occurrence of the query's own token (key i - o): a "
        "duplicate-token score. An induction head looks one further, at key i - o + 1.",
        _link("16_induction_heads", "claims-2-and-3"),
    ),
    "induction_over_all_queries": Bug(
        "The mean ran over every query from position o - 1 on; the queries of eq. 16.2 are those "
        "whose next token is a copy, i from o to T - 2.",
        _link("16_induction_heads", "claims-2-and-3"),
    ),
    "bits_per_token": Bug(
        "The loss became bits per token, not per byte: the total bits are divided by the "
        "tokens where the bytes of the text belong.",
        _link("17_language_model", "what-it-learned"),
    ),
    "nats_not_bits": Bug(
        "The loss stayed in nats: one bit is ln 2 nats, so divide by ln 2.",
        _link("17_language_model", "what-it-learned"),
    ),
    "composition_not_normalised": Bug(
        "||W_QK W_OV||_F was not divided by ||W_QK||_F ||W_OV||_F, so the score grows with the "
        "size of the weights; normalised, it compares heads of any scale.",
        _link("18_circuits", "composition"),
    ),
    "composition_order_swapped": Bug(
        "The product ran the other way, W_OV W_QK: the earlier head's output (W_OV) is what the "
        "later head's W_QK reads, so the product is W_QK W_OV.",
        _link("18_circuits", "composition"),
    ),
    "merge_plain_average": Bug(
        "The two partial outputs were averaged with equal weights; each part weighs "
        "e^(L_part - L), its share of the whole softmax's denominator.",
        _link("19_merging_partials", "two-partial-answers"),
    ),
    "merge_without_max": Bug(
        "e^L was taken without a shift: it overflows for L above about 88 in float32, and a "
        "query that saw no key in either part gives -inf - (-inf) = NaN. Shift by the larger L, "
        "and give a part with L = -inf the weight 0.",
        _link("19_merging_partials", "two-partial-answers"),
    ),
    "ring_partials_averaged": Bug(
        "The shards' partial outputs were averaged; merge them with their log-sum-exps "
        "(eq. 19.1), so that each shard counts with its share of the softmax.",
        _link("20_ring_attention", "the-ring"),
    ),
    "ring_empty_shard_nan": Bug(
        "A shard wholly in a query's future makes a softmax over a row of -inf, NaN, and NaN "
        "times the weight 0 is still NaN: such a partial must be 0 with L = -inf.",
        _link("20_ring_attention", "the-ring"),
    ),
}


# ---- references and wrong versions; every one takes the reader's arguments -------------------


def _f64(*xs):
    return tuple(x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in xs)


def _attend(q, k, v, visible, scale=None, dim=-1, after=None):
    """Dense attention in float64 with boolean visible [T, S]: the template of several bugs."""
    q, k, v = _f64(q, k, v)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # [B, H, T, S]
    if after is None:
        return softmax(scores.masked_fill(~visible, -math.inf), dim=dim) @ v
    weights = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    if after == "renormalise":
        weights = weights / weights.sum(-1, keepdim=True)  # 0/0 = NaN where the future won
    return weights @ v


def _tril(t, s, offset=0):
    return torch.ones(t, s, dtype=torch.bool).tril(offset)


def _ref_causal(q, k, v):
    return causal_attention(*_f64(q, k, v))


def _causal_bug(**kw):
    def wrong(q, k, v):
        t = q.shape[2]
        return _attend(q, k, v, _tril(t, t), **kw)

    return wrong


def _mask_inverted(q, k, v):
    t = q.shape[2]
    return _attend(q, k, v, ~_tril(t, t))


def _mask_hides_diagonal(q, k, v):
    t = q.shape[2]
    return _attend(q, k, v, _tril(t, t, -1))


def _reshape_without_transpose(x, heads):
    b, t, f = x.shape
    return x.reshape(b, heads, t, f // heads)


def _transpose_wrong_axes(x, heads):
    b, t, f = x.shape
    return x.transpose(1, 2).reshape(b, heads, t, f // heads)


def _top_left(q, k, v):
    return _attend(q, k, v, _tril(q.shape[2], k.shape[2]))


def _ref_kv(q, k, v, k_cache, v_cache):
    return causal_attention(*_f64(q, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)))


def _cache_not_read(q, k, v, k_cache, v_cache):
    return causal_attention(*_f64(q, k, v))


def _repeat_not_interleave(q, k, v):
    g = q.shape[1] // k.shape[1]
    t = q.shape[2]
    return _attend(q, k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1), _tril(t, t))


def _ref_rope(x, positions):
    cos, sin = rope_cos_sin(positions, x.shape[-1])
    return apply_rope(x.double(), cos.double(), sin.double())


def _rope_interleaved(x, positions):
    """The interleaved layout: features (2i, 2i+1) turn together by the angle of pair i."""
    cos, sin = rope_cos_sin(positions, x.shape[-1])  # [T, D]: pair i's angle at i and i + D/2
    half = x.shape[-1] // 2
    cos, sin = (c[:, :half].double().repeat_interleave(2, -1) for c in (cos, sin))
    x = x.double()
    turned = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)  # (-x1, x0, -x3, x2..)
    return x * cos + turned * sin


def _rope_off_by_one(x, positions):
    return _ref_rope(x, positions + 1)


def _ref_rope_attention(q, k, v, positions):
    return _ref_causal(_ref_rope(q, positions), _ref_rope(k, positions), v)


def _rope_on_v(q, k, v, positions):
    return _ref_causal(_ref_rope(q, positions), _ref_rope(k, positions), _ref_rope(v, positions))


def _ref_online(scores, values, block):
    scores, values = _f64(scores, values)
    return softmax(scores, dim=-1) @ values


def _online(scores, values, block, rescale_sum=True, rescale_out=True):
    """Online softmax over key blocks (eqs. 14.1-14.2), optionally without a rescale."""
    scores, values = _f64(scores, values)
    m = torch.full((scores.shape[0], 1), torch.finfo(torch.float64).min, dtype=torch.float64)
    ell = torch.zeros_like(m)
    o = torch.zeros(scores.shape[0], values.shape[1], dtype=torch.float64)
    for j in range(0, scores.shape[1], block):
        s = scores[:, j : j + block]
        new_m = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha, w = torch.exp(m - new_m), torch.exp(s - new_m)
        ell = (ell * alpha if rescale_sum else ell) + w.sum(-1, keepdim=True)
        o = (o * alpha if rescale_out else o) + w @ values[j : j + block]
        m = new_m
    return o / ell.masked_fill(ell == 0, 1.0)


def _ref_backward(q, k, v, dout):
    q, k, v, dout = (x.double().requires_grad_() for x in (q, k, v, dout))
    with torch.enable_grad():
        return torch.autograd.grad(causal_attention(q, k, v), (q, k, v), dout)


def _backward_without_delta(q, k, v, dout):
    q, k, v, dout = _f64(q, k, v, dout)
    scale, t = 1 / math.sqrt(q.shape[-1]), q.shape[2]
    p = softmax((q @ k.transpose(-2, -1) * scale).masked_fill(~_tril(t, t), -math.inf))
    ds = p * (dout @ v.transpose(-2, -1))  # the bug: no "- delta"
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


def _ref_padded(q, k, v, lengths):
    positions, allowed = left_padding(lengths, q.shape[2])
    return causal_attention(*_f64(q, k, v), positions, positions, allowed)


def _pads_not_masked(q, k, v, lengths):
    return _ref_causal(q, k, v)


def _masked_row_nan(q, k, v, lengths):
    out = _ref_padded(q, k, v, lengths).clone()
    for b, n in enumerate(lengths):
        out[b, :, : q.shape[2] - n] = math.nan
    return out


# ---- chapters 1-4, 10-13 and 16 ----------------------------------------------------------------


def _ref_context(x):
    x = x.double()
    return softmax(x @ x.T) @ x


def _plain_sum_context(x):
    scores = x.double() @ x.double().T
    return scores / scores.sum(-1, keepdim=True) @ x.double()


def _columns_context(x):
    x = x.double()
    return softmax(x @ x.T, dim=0) @ x


def _qkv(x, w_q, w_k, w_v, key_matrix=None, width=None):
    x, w_q, w_k, w_v = _f64(x, w_q, w_k, w_v)
    q, k = x @ w_q, x @ (w_k if key_matrix is None else key_matrix.double())
    width = w_k.shape[1] if width is None else width
    return softmax(q @ k.T / math.sqrt(width)) @ (x @ w_v)


def _ref_scores(q, k, scale=None):
    q, k = _f64(q, k)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q @ k.transpose(-2, -1) * scale


def _ref_jacobian(a):
    a = a.double()
    return torch.diag(a) - a[:, None] * a[None, :]


def _ref_softmax(z):
    return softmax(z.double())


def _softmax_without_max(z):
    e = z.float().exp()  # float32, as a reader's tensors are: overflows above about 88
    return (e / e.sum(-1, keepdim=True)).double()


_BYTES_DTYPES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _ref_cache_bytes(batch, layers, q_heads, kv_heads, head_dim, tokens, bytes_per_number):
    dtype = _BYTES_DTYPES[bytes_per_number]
    return kv_cache_bytes(tokens, layers, kv_heads, head_dim, dtype, batch)


def _ref_loops(q, k, v):
    return _ref_causal(q[None, None], k[None, None], v[None, None])[0, 0]


def _loops_without_max(q, k, v):
    t, s = q.shape[0], k.shape[0]
    e = (q.float() @ k.float().T / math.sqrt(q.shape[-1])).exp()  # float32: inf above 88
    e = e.masked_fill(~_tril(t, s, s - t), 0.0)
    return (e / e.sum(-1, keepdim=True)).double() @ v.double()


def _ref_rmsnorm(x, weight, eps, over=1):
    x = x.double()
    squares = x.pow(2).flatten(-over).mean(-1)[(...,) + (None,) * over]
    return x / torch.sqrt(squares + eps) * weight.double()


def _rmsnorm_eps_outside(x, weight, eps):
    x = x.double()
    return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight.double()


def _ref_flops(batch, heads, queries, keys, head_dim, causal):
    return attention_flops(queries, keys, head_dim, heads=heads, batch=batch, causal=causal)


def _flops_causal_half(batch, heads, queries, keys, head_dim, causal):
    pairs = queries * keys / 2 if causal else queries * keys
    return 4 * pairs * head_dim * heads * batch


def _induction(weights, offset, first=None, back=None):
    """The mean over queries i = first .. T-2 of weights[:, i, i - back] (eq. 16.2's defaults)."""
    first, back = offset if first is None else first, offset - 1 if back is None else back
    i = torch.arange(first, weights.shape[-1] - 1)
    return weights.double()[:, i, i - back].mean(-1)


# ---- chapters 17-20 ------------------------------------------------------------------------


def _bits_per_byte(loss, tokens, text_bytes, per_byte=True, bits=True):
    total = loss * tokens / (math.log(2) if bits else 1.0)
    return total / (text_bytes if per_byte else tokens)


def _composition(w_qk, w_ov, normalised=True, swapped=False):
    w_qk, w_ov = w_qk.double(), w_ov.double()
    product = w_ov @ w_qk if swapped else w_qk @ w_ov
    scale = torch.linalg.matrix_norm(w_qk) * torch.linalg.matrix_norm(w_ov) if normalised else 1
    return torch.linalg.matrix_norm(product) / scale


def _ref_merge(out_a, lse_a, out_b, lse_b):
    return merge_attention(*_f64(out_a, lse_a, out_b, lse_b))


def _merge_average(out_a, lse_a, out_b, lse_b):
    out_a, lse_a, out_b, lse_b = _f64(out_a, lse_a, out_b, lse_b)
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def _merge_without_max(out_a, lse_a, out_b, lse_b):
    lse = torch.log(lse_a.float().exp() + lse_b.float().exp())  # float32: inf above 88
    out = (lse_a - lse).exp()[..., None] * out_a + (lse_b - lse).exp()[..., None] * out_b
    return out.double(), lse.double()


def _shard_partials(q, k, v, processes, torch_softmax=False):
    """Per contiguous shard of the keys: (out, lse) of every query over that shard (causal)."""
    q, k, v = _f64(q, k, v)
    t, size = q.shape[2], q.shape[2] // processes
    parts = []
    for j0 in range(0, t, size):
        visible = _tril(t, t)[:, j0 : j0 + size]  # [T, size]
        scores = (q @ k[:, :, j0 : j0 + size].transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~visible, -math.inf)
        weights = torch.softmax(scores, -1) if torch_softmax else softmax(scores)
        parts.append((weights @ v[:, :, j0 : j0 + size], scores.logsumexp(-1)))
    return parts


def _ring(q, k, v, processes, torch_softmax=False):
    parts = _shard_partials(q, k, v, processes, torch_softmax)
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = merge_attention(out, lse, *part)
    return out


def _ring_averaged(q, k, v, processes):
    parts = _shard_partials(q, k, v, processes)
    seen = torch.stack([torch.isfinite(lse) for _, lse in parts]).double().sum(0)  # [B, H, T]
    return sum(out for out, _ in parts) / seen[..., None]


_WRONG = {
    "softmax_over_queries": _causal_bug(dim=-2),
    "mask_after_softmax": _causal_bug(after="zero"),
    "mask_after_softmax_renormalised": _causal_bug(after="renormalise"),
    "mask_inverted": _mask_inverted,
    "mask_hides_diagonal": _mask_hides_diagonal,
    "reshape_without_transpose": _reshape_without_transpose,
    "transpose_wrong_axes": _transpose_wrong_axes,
    "cache_not_read": _cache_not_read,
    "repeat_not_interleave": _repeat_not_interleave,
    "rope_interleaved_pairs": _rope_interleaved,
    "rope_rotate_half_pairs": lambda x, positions: _ref_rope(x, positions),
    "rope_positions_off_by_one": _rope_off_by_one,
    "rope_on_v": _rope_on_v,
    "online_sum_not_rescaled": lambda s, v, b: _online(s, v, b, rescale_sum=False),
    "online_output_not_rescaled": lambda s, v, b: _online(s, v, b, rescale_out=False),
    "backward_without_delta": _backward_without_delta,
    "pads_not_masked": _pads_not_masked,
    "masked_row_nan": _masked_row_nan,
    "plain_sum_weights": _plain_sum_context,
    "weights_over_columns": _columns_context,
    "keys_projected_by_w_q": lambda x, w_q, w_k, w_v: _qkv(x, w_q, w_k, w_v, key_matrix=w_q),
    "scale_by_value_width": lambda x, w_q, w_k, w_v: _qkv(x, w_q, w_k, w_v, width=w_v.shape[1]),
    "scale_by_key_count": lambda q, k: _ref_scores(q, k, 1 / math.sqrt(k.shape[-2])),
    "jacobian_diagonal_only": lambda a: torch.diag(a.double() * (1 - a.double())),
    "jacobian_sign_of_outer": lambda a: torch.diag(a.double()) + torch.outer(a, a).double(),
    "softmax_without_max": {
        "stable_softmax": _softmax_without_max,
        "attention_loops": _loops_without_max,
    },
    "top_left_mask": {
        "decode_attention": _top_left,
        "attention_loops": lambda q, k, v: _top_left(*(x[None, None] for x in (q, k, v)))[0, 0],
    },
    "scale_by_d": {
        "causal_attention": lambda q, k, v: _causal_bug(scale=1 / q.shape[-1])(q, k, v),
        "scaled_scores": lambda q, k: _ref_scores(q, k, 1 / q.shape[-1]),
    },
    "no_scale": {
        "causal_attention": _causal_bug(scale=1.0),
        "scaled_scores": lambda q, k: _ref_scores(q, k, 1.0),
    },
    "cache_bytes_with_query_heads": lambda b, n, hq, hkv, dh, s, nb: _ref_cache_bytes(
        b, n, hq, hq, dh, s, nb
    ),
    "cache_bytes_keys_only": lambda *args: _ref_cache_bytes(*args) // 2,
    "rmsnorm_eps_outside_sqrt": _rmsnorm_eps_outside,
    "rmsnorm_over_all_heads": lambda x, weight, eps: _ref_rmsnorm(x, weight, eps, over=2),
    "flops_one_product": lambda *args: _ref_flops(*args) // 2,
    "flops_causal_half": _flops_causal_half,
    "induction_same_token": lambda w, offset: _induction(w, offset, back=offset),
    "induction_over_all_queries": lambda w, offset: _induction(w, offset, first=offset - 1),
    "bits_per_token": lambda loss, n, size: _bits_per_byte(loss, n, size, per_byte=False),
    "nats_not_bits": lambda loss, n, size: _bits_per_byte(loss, n, size, bits=False),
    "composition_not_normalised": lambda w_qk, w_ov: _composition(w_qk, w_ov, normalised=False),
    "composition_order_swapped": lambda w_qk, w_ov: _composition(w_qk, w_ov, swapped=True),
    "merge_plain_average": _merge_average,
    "merge_without_max": _merge_without_max,
    "ring_partials_averaged": _ring_averaged,
    "ring_empty_shard_nan": lambda q, k, v, p: _ring(q, k, v, p, torch_softmax=True),
}


def _wrong(exercise: str, bug: str) -> Callable:
    """The wrong version of `bug` with the signature of `exercise`."""
    wrong = _WRONG[bug]
    return wrong[exercise] if isinstance(wrong, dict) else wrong


# ---- the cases: seeded, small, awkward -----------------------------------------------------


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _qkv_cases(shapes, seed, spike=False):
    """q [B, Hq, T, D], k and v [B, Hkv, S, D] for each (B, Hq, Hkv, T, S, D) in shapes."""
    gen, cases = torch.Generator().manual_seed(seed), []
    for b, hq, hkv, t, s, d in shapes:
        q, k, v = _randn(gen, b, hq, t, d), _randn(gen, b, hkv, s, d), _randn(gen, b, hkv, s, d)
        heads = f"H={hq}" if hq == hkv else f"Hq={hq}, Hkv={hkv}"
        tokens = f"T={t}" if s == t else f"T={t}, S={s}"
        cases.append(Case((q, k, v), f"B={b}, {heads}, {tokens}, D={d}"))
    if spike:  # the last key outscores the others by thousands: only its own query may see it
        b, h, t, d = 1, 2, 5, 8
        q = _randn(gen, b, h, t, d).abs() + 0.5
        k, v = _randn(gen, b, h, t, d), _randn(gen, b, h, t, d)
        k[:, :, -1] = 1000.0
        cases.append(Case((q, k, v), f"B={b}, H={h}, T={t}, D={d}, one future key outscores all"))
    return cases


def _causal_cases():
    shapes = [(2, 3, 3, 5, 5, 8), (1, 2, 2, 7, 7, 4), (3, 1, 1, 4, 4, 16), (1, 1, 1, 1, 1, 4)]
    return _qkv_cases(shapes, 0, spike=True)


def _split_cases():
    gen, cases = torch.Generator().manual_seed(1), []
    for b, t, h, dh in [(2, 5, 3, 4), (1, 4, 2, 6), (3, 2, 4, 2), (1, 1, 2, 3)]:
        cases.append(Case((_randn(gen, b, t, h * dh), h), f"B={b}, T={t}, H={h}, Dh={dh}"))
    return cases


def _decode_cases():
    shapes = [(2, 2, 2, 1, 7, 8), (1, 3, 3, 3, 9, 4), (2, 2, 2, 2, 5, 8), (1, 2, 2, 4, 4, 4)]
    return _qkv_cases(shapes, 2)


def _kv_cases():
    gen, cases = torch.Generator().manual_seed(3), []
    for b, h, s, d in [(2, 2, 6, 8), (1, 3, 1, 4), (1, 1, 9, 16)]:
        new = [_randn(gen, b, h, 1, d) for _ in range(3)]
        cache = [_randn(gen, b, h, s, d) for _ in range(2)]
        cases.append(Case((*new, *cache), f"B={b}, H={h}, S={s} cached, D={d}"))
    return cases


def _gqa_cases():
    shapes = [(2, 4, 2, 5, 5, 8), (1, 6, 3, 6, 6, 4), (1, 6, 2, 4, 4, 8), (1, 2, 2, 3, 3, 4)]
    return _qkv_cases(shapes, 4)


def _rope_cases():
    gen, cases = torch.Generator().manual_seed(5), []
    for b, h, t, d, start in [(2, 2, 5, 8, 0), (1, 3, 4, 4, 7), (1, 1, 6, 16, 0), (2, 1, 3, 6, 2)]:
        positions = torch.arange(start, start + t)
        cases.append(
            Case(
                (_randn(gen, b, h, t, d), positions),
                f"B={b}, H={h}, T={t}, D={d}, positions {start}..{start + t - 1}",
            )
        )
    return cases


def _rope_attention_cases():
    gen, cases = torch.Generator().manual_seed(6), []
    for b, h, t, d, start in [(2, 2, 5, 8, 0), (1, 3, 6, 4, 3), (1, 1, 4, 16, 0)]:
        q, k, v = (_randn(gen, b, h, t, d) for _ in range(3))
        positions = torch.arange(start, start + t)
        label = f"B={b}, H={h}, T={t}, D={d}, positions {start}..{start + t - 1}"
        cases.append(Case((q, k, v, positions), label))
    return cases


def _online_cases():
    gen, cases = torch.Generator().manual_seed(7), []
    for t, s, dv, block in [(3, 10, 4, 3), (4, 7, 2, 2), (2, 16, 3, 4), (5, 9, 4, 1)]:
        scores = 2 * _randn(gen, t, s) + torch.linspace(0, 8, s)  # the maximum keeps moving
        cases.append(
            Case((scores, _randn(gen, s, dv), block), f"T={t}, S={s}, Dv={dv}, block={block}")
        )
    scores = 2 * _randn(gen, 4, 8) + torch.linspace(0, 8, 8)
    scores = scores.masked_fill(~_tril(4, 8, 4), -math.inf)
    scores[0] = -math.inf  # a row that sees no key gives zeros
    cases.append(
        Case((scores, _randn(gen, 8, 3), 3), "T=4, S=8, Dv=3, block=3, masked, row 0 all -inf")
    )
    return cases


def _backward_cases():
    gen, cases = torch.Generator().manual_seed(8), []
    for b, h, t, d in [(2, 2, 5, 8), (1, 3, 4, 4), (1, 1, 6, 16)]:
        args = tuple(_randn(gen, b, h, t, d) for _ in range(4))
        cases.append(Case(args, f"B={b}, H={h}, T={t}, D={d}"))
    return cases


def _padded_cases():
    gen, cases = torch.Generator().manual_seed(9), []
    for b, h, t, d, lengths in [
        (3, 2, 5, 8, [5, 3, 1]),
        (2, 1, 4, 4, [2, 4]),
        (2, 2, 3, 4, [0, 3]),
    ]:
        q, k, v = (_randn(gen, b, h, t, d) for _ in range(3))
        cases.append(Case((q, k, v, lengths), f"B={b}, H={h}, T={t}, D={d}, lengths {lengths}"))
    return cases


def _context_cases():
    gen = torch.Generator().manual_seed(11)
    return [
        Case((_randn(gen, t, d),), f"T={t}, d={d}") for t, d in [(6, 3), (4, 5), (1, 2), (7, 4)]
    ]


def _qkv_weights_cases():
    gen, cases = torch.Generator().manual_seed(12), []
    for t, dm, dk, dv in [(6, 3, 2, 4), (5, 4, 3, 2), (1, 3, 2, 5), (4, 6, 5, 3)]:
        args = (_randn(gen, t, dm), _randn(gen, dm, dk), _randn(gen, dm, dk), _randn(gen, dm, dv))
        cases.append(Case(args, f"T={t}, d_model={dm}, d_k={dk}, d_v={dv}"))
    return cases


def _scores_cases():
    gen, cases = torch.Generator().manual_seed(13), []
    for b, h, t, s, d in [(2, 2, 3, 5, 8), (1, 3, 4, 4, 16), (1, 1, 6, 2, 4), (2, 1, 1, 7, 9)]:
        args = (_randn(gen, b, h, t, d), _randn(gen, b, h, s, d))
        cases.append(Case(args, f"B={b}, H={h}, T={t}, S={s}, D={d}"))
    return cases


def _jacobian_cases():
    gen = torch.Generator().manual_seed(14)
    return [Case((softmax(2 * _randn(gen, n)),), f"n={n}") for n in (4, 6, 2, 1)]


def _softmax_cases():
    gen = torch.Generator().manual_seed(15)
    large = torch.tensor([[1000.0, 999.0, 990.0, -5.0], [-1000.0, -1001.0, -1002.0, -1003.0]])
    masked = torch.tensor([[0.0, -math.inf, 1.0], [2.0, 2.0, -math.inf]])
    return [
        Case((3 * _randn(gen, 3, 5),), "3 rows of 5 scores"),
        Case((large,), "scores near +1000 and -1000"),
        Case((masked,), "rows with a -inf score"),
        Case((_randn(gen, 1, 1),), "one score"),
    ]


def _cache_bytes_cases():
    sizes = [(1, 28, 16, 8, 128, 32768, 2), (4, 2, 8, 2, 64, 100, 4), (2, 3, 6, 3, 16, 7, 8)]
    sizes.append((1, 1, 4, 1, 32, 1, 1))
    names = "batch layers q_heads kv_heads head_dim tokens bytes_per_number".split()
    return [Case(s, ", ".join(f"{n}={v}" for n, v in zip(names, s))) for s in sizes]


def _loops_cases():
    gen, cases = torch.Generator().manual_seed(16), []
    for t, s, d, dv, largest in [
        (3, 5, 4, 2, 0),
        (4, 4, 8, 3, 0),
        (1, 6, 2, 2, 0),
        (2, 5, 4, 3, 800),
    ]:
        q, k, v = _randn(gen, t, d), _randn(gen, s, d), _randn(gen, s, dv)
        label = f"T={t}, S={s}, D={d}, Dv={dv}"
        if largest:  # rescale so that the largest |score| is exactly `largest`
            grow = math.sqrt(largest / float((q @ k.T).abs().max() / math.sqrt(d)))
            q, k, label = q * grow, k * grow, label + f", scores up to {largest}"
        cases.append(Case((q, k, v), label))
    return cases


def _rmsnorm_cases():
    gen, cases = torch.Generator().manual_seed(17), []
    for b, t, h, d, eps in [(2, 3, 2, 4, 0.1), (1, 4, 3, 8, 0.5), (1, 2, 2, 6, 1e-6)]:
        x, weight = 0.3 * _randn(gen, b, t, h, d), 1 + 0.5 * _randn(gen, d)
        cases.append(Case((x, weight, eps), f"B={b}, T={t}, H={h}, D={d}, eps={eps:g}"))
    return cases


def _flops_cases():
    sizes = [(1, 8, 8192, 8192, 64, False), (2, 4, 16, 16, 32, True), (1, 2, 3, 10, 8, True)]
    sizes.append((3, 1, 5, 5, 4, False))
    names = "batch heads queries keys head_dim causal".split()
    return [Case(s, ", ".join(f"{n}={v}" for n, v in zip(names, s))) for s in sizes]


def _induction_cases():
    gen, cases = torch.Generator().manual_seed(18), []
    for h, t, offset in [(2, 10, 4), (3, 16, 8), (1, 7, 3), (4, 12, 5)]:
        scores = 2 * _randn(gen, h, t, t)
        weights = softmax(scores.masked_fill(~_tril(t, t), -math.inf))  # [H, T, T], causal
        cases.append(Case((weights, offset), f"H={h}, T={t}, offset={offset}"))
    return cases


def _bits_cases():
    sizes = [(4.0, 1000, 3500), (2.3, 512, 2048), (1.0, 100, 100), (0.5, 7, 29)]
    return [Case(s, f"loss={s[0]}, tokens={s[1]}, text_bytes={s[2]}") for s in sizes]


def _composition_cases():
    gen = torch.Generator().manual_seed(19)
    return [Case((_randn(gen, d, d), 3 * _randn(gen, d, d)), f"d={d}") for d in (4, 8, 3, 16)]


def _merge_cases():
    gen, cases = torch.Generator().manual_seed(20), []
    for shape, shift in [((2, 2, 3, 4), 0.0), ((1, 3, 5, 2), 100.0), ((2, 1, 4, 3), 0.0)]:
        out_a, out_b = _randn(gen, *shape), _randn(gen, *shape)
        lse_a, lse_b = (3 * _randn(gen, *shape[:-1]) + shift for _ in "ab")
        label = f"out {list(shape)}" + (f", L near {shift:g}" if shift else "")
        cases.append(Case((out_a, lse_a, out_b, lse_b), label))
    out_a, out_b = _randn(gen, 1, 1, 3, 2), torch.zeros(1, 1, 3, 2)
    lse_a, lse_b = torch.tensor([[[0.5, -math.inf, 2.0]]]), torch.full((1, 1, 3), -math.inf)
    out_a[0, 0, 1] = 0.0  # a query that saw no key in either part
    cases.append(Case((out_a, lse_a, out_b, lse_b), "parts with L = -inf"))
    return cases


def _ring_cases():
    gen, cases = torch.Generator().manual_seed(21), []
    for b, h, t, d, processes in [
        (1, 2, 8, 4, 2),
        (2, 1, 12, 8, 3),
        (1, 2, 8, 4, 4),
        (1, 1, 6, 4, 1),
    ]:
        q, k, v = (_randn(gen, b, h, t, d) for _ in range(3))
        cases.append(Case((q, k, v, processes), f"B={b}, H={h}, T={t}, D={d}, P={processes}"))
    return cases


# ---- probes: with v = identity the output of attention is its weight matrix -----------------


def _attention_probe(hq=2, hkv=2, t=6, s=6):
    gen = torch.Generator().manual_seed(10)
    q, k = _randn(gen, 1, hq, t, s), _randn(gen, 1, hkv, s, s)
    v = torch.eye(s).expand(1, hkv, s, s).clone()
    return (q, k, v), _tril(t, s, s - t)


def _probes():
    (q, k, eye), _ = _attention_probe()
    q, k, eye = (torch.cat([x, x]) for x in (q, k, eye))  # B = 2 for the padded batch
    pad_allowed = left_padding([6, 4], 6)[1]  # [2, 1, 1, 6]
    return {
        "causal_attention": _attention_probe(),
        "decode_attention": _attention_probe(t=3, s=8),
        "grouped_query_attention": _attention_probe(hq=4),
        "rope_attention": (_attention_probe()[0] + (torch.arange(6),), _tril(6, 6)),
        "kv_cache_decode": (
            (q[:, :, -1:], k[:, :, -1:], eye[:, :, -1:], k[:, :, :-1], eye[:, :, :-1]),
            torch.ones(1, 6, dtype=torch.bool),
        ),
        "padded_attention": ((q, k, eye, [6, 4]), _tril(6, 6) & pad_allowed),
        "online_softmax": (
            (torch.linspace(0, 4, 24).reshape(4, 6), torch.eye(6), 2),
            torch.ones(4, 6, dtype=torch.bool),
        ),
    }


class Exercise(NamedTuple):
    """An exercise: its signature, one line of description, cases, reference and bugs."""

    signature: str
    description: str
    cases: Callable
    reference: Callable
    outputs: tuple  # names and shapes of the outputs, e.g. ("out [B, H, T, D]",)
    bugs: tuple


EXERCISES = {
    "causal_attention": Exercise(
        "fn(q, k, v) -> out; q, k, v [B, H, T, D] -> [B, H, T, D]",
        "Causal scaled dot-product attention, positions 0..T-1, scale 1/sqrt(D).",
        _causal_cases,
        _ref_causal,
        ("out [B, H, T, D]",),
        (
            "scale_by_d",
            "no_scale",
            "softmax_over_queries",
            "mask_after_softmax",
            "mask_after_softmax_renormalised",
            "mask_inverted",
            "mask_hides_diagonal",
        ),
    ),
    "split_heads": Exercise(
        "fn(x, heads) -> out; x [B, T, H*Dh] -> [B, H, T, Dh]",
        "Split the features into heads and move the heads in front of the tokens.",
        _split_cases,
        split_heads,
        ("out [B, H, T, Dh]",),
        ("reshape_without_transpose", "transpose_wrong_axes"),
    ),
    "decode_attention": Exercise(
        "fn(q, k, v) -> out; q [B, H, T, D], k and v [B, H, S, D] with T <= S -> [B, H, T, D]",
        "The T queries are the last T of S positions: key j is visible to query i iff j <= S-T+i.",
        _decode_cases,
        _ref_causal,
        ("out [B, H, T, D]",),
        ("top_left_mask",),
    ),
    "kv_cache_decode": Exercise(
        "fn(q, k, v, k_cache, v_cache) -> out; q, k, v [B, H, 1, D], caches [B, H, S, D] -> "
        "[B, H, 1, D]",
        "One decode step: the new token's query attends to the S cached keys and its own key.",
        _kv_cases,
        _ref_kv,
        ("out [B, H, 1, D]",),
        ("cache_not_read",),
    ),
    "grouped_query_attention": Exercise(
        "fn(q, k, v) -> out; q [B, Hq, T, D], k and v [B, Hkv, T, D] -> [B, Hq, T, D]",
        "Causal attention where query head h reads KV head h // (Hq / Hkv).",
        _gqa_cases,
        _ref_causal,
        ("out [B, Hq, T, D]",),
        ("repeat_not_interleave",),
    ),
    "rope": Exercise(
        "fn(x, positions) -> out; x [B, H, T, D], positions [T] (int) -> [B, H, T, D]",
        "RoPE, rotate-half layout (feature i pairs with i + D/2), base 10000.",
        _rope_cases,
        _ref_rope,
        ("out [B, H, T, D]",),
        ("rope_interleaved_pairs", "rope_positions_off_by_one"),
    ),
    "rope_interleaved": Exercise(
        "fn(x, positions) -> out; x [B, H, T, D], positions [T] (int) -> [B, H, T, D]",
        "RoPE, interleaved layout (features 2i and 2i+1 turn together), base 10000.",
        _rope_cases,
        _rope_interleaved,
        ("out [B, H, T, D]",),
        ("rope_rotate_half_pairs",),
    ),
    "rope_attention": Exercise(
        "fn(q, k, v, positions) -> out; q, k, v [B, H, T, D], positions [T] -> [B, H, T, D]",
        "Causal attention with RoPE (rotate-half, base 10000) at the given positions.",
        _rope_attention_cases,
        _ref_rope_attention,
        ("out [B, H, T, D]",),
        ("rope_on_v",),
    ),
    "online_softmax": Exercise(
        "fn(scores, values, block) -> out; scores [T, S], values [S, Dv] -> [T, Dv]",
        "softmax(scores) @ values one block of `block` keys at a time (a row of -inf gives 0).",
        _online_cases,
        _ref_online,
        ("out [T, Dv]",),
        ("online_sum_not_rescaled", "online_output_not_rescaled"),
    ),
    "attention_backward": Exercise(
        "fn(q, k, v, dout) -> (dq, dk, dv); all [B, H, T, D]",
        "The gradients of causal attention (scale 1/sqrt(D)) given dout, without autograd.",
        _backward_cases,
        _ref_backward,
        ("dq [B, H, T, D]", "dk [B, H, T, D]", "dv [B, H, T, D]"),
        ("backward_without_delta",),
    ),
    "padded_attention": Exercise(
        "fn(q, k, v, lengths) -> out; q, k, v [B, H, T, D], lengths [B] ints -> [B, H, T, D]",
        "A left-padded batch: row b holds T - lengths[b] pads, then its tokens at positions "
        "0, 1, ...; causal among real tokens, no key is a pad, a pad's output is 0.",
        _padded_cases,
        _ref_padded,
        ("out [B, H, T, D]",),
        ("pads_not_masked", "masked_row_nan"),
    ),
    "context_vectors": Exercise(
        "fn(x) -> out; x [T, d] -> [T, d]",
        "Attention with no parameters: row i of the output mixes the rows of x with the weights "
        "softmax(x x^T) of row i; every token sees every token, no scale.",
        _context_cases,
        _ref_context,
        ("out [T, d]",),
        ("plain_sum_weights", "weights_over_columns"),
    ),
    "qkv_attention": Exercise(
        "fn(x, w_q, w_k, w_v) -> out; x [T, d_model], w_q and w_k [d_model, d_k], "
        "w_v [d_model, d_v] -> [T, d_v]",
        "Project x into Q, K and V (eq. 2.1) and attend (eq. 2.2) with no mask.",
        _qkv_weights_cases,
        _qkv,
        ("out [T, d_v]",),
        ("keys_projected_by_w_q", "scale_by_value_width"),
    ),
    "scaled_scores": Exercise(
        "fn(q, k) -> scores; q [B, H, T, D], k [B, H, S, D] -> [B, H, T, S]",
        "The scaled scores of eq. 3.3, q k^T / sqrt(D), for every query and key.",
        _scores_cases,
        _ref_scores,
        ("scores [B, H, T, S]",),
        ("scale_by_d", "no_scale", "scale_by_key_count"),
    ),
    "stable_softmax": Exercise(
        "fn(z) -> a; z [R, n] -> [R, n]",
        "The softmax of each row (eq. 4.1), safe for scores of any size and for -inf entries.",
        _softmax_cases,
        _ref_softmax,
        ("a [R, n]",),
        ("softmax_without_max",),
    ),
    "softmax_jacobian": Exercise(
        "fn(a) -> jacobian; a [n], a softmax output -> [n, n]",
        "The Jacobian of the softmax from its output (eq. 4.2): entry (i, j) is da_i/dz_j.",
        _jacobian_cases,
        _ref_jacobian,
        ("jacobian [n, n]",),
        ("jacobian_diagonal_only", "jacobian_sign_of_outer"),
    ),
    "kv_cache_bytes": Exercise(
        "fn(batch, layers, q_heads, kv_heads, head_dim, tokens, bytes_per_number) -> bytes",
        "The bytes of a KV cache holding `tokens` tokens per sequence (eq. 10.1).",
        _cache_bytes_cases,
        _ref_cache_bytes,
        ("bytes (a number)",),
        ("cache_bytes_with_query_heads", "cache_bytes_keys_only"),
    ),
    "attention_loops": Exercise(
        "fn(q, k, v) -> out; q [T, D], k [S, D], v [S, Dv] with T <= S -> [T, Dv]",
        "One head, loop by loop: query i (at position S-T+i) against the keys it may see, with "
        "the stable softmax and scale 1/sqrt(D).",
        _loops_cases,
        _ref_loops,
        ("out [T, Dv]",),
        ("top_left_mask", "softmax_without_max"),
    ),
    "qk_norm": Exercise(
        "fn(x, weight, eps) -> out; x [B, T, H, D], weight [D], eps a float -> [B, T, H, D]",
        "Qwen3's RMSNorm of every head's query or key vector, with gains `weight`.",
        _rmsnorm_cases,
        _ref_rmsnorm,
        ("out [B, T, H, D]",),
        ("rmsnorm_eps_outside_sqrt", "rmsnorm_over_all_heads"),
    ),
    "attention_flops": Exercise(
        "fn(batch, heads, queries, keys, head_dim, causal) -> flops",
        "The FLOPs of the two products of eq. 2.2 (D_v = D); causal counts only the pairs that "
        "query i, at position keys - queries + i, may see.",
        _flops_cases,
        _ref_flops,
        ("flops (a number)",),
        ("flops_one_product", "flops_causal_half"),
    ),
    "induction_score": Exercise(
        "fn(weights, offset) -> scores; weights [H, T, T], offset o -> [H]",
        "Tokens o.. T-1 repeat tokens 0.. T-1-o. Each head's induction score, eq. 16.2: its mean "
        "weight on key i - o + 1 over the queries i = o .. T-2.",
        _induction_cases,
        _induction,
        ("scores [H]",),
        ("induction_same_token", "induction_over_all_queries"),
    ),
    "bits_per_byte": Exercise(
        "fn(loss, tokens, text_bytes) -> bits; loss in nats per token, counts as ints",
        "The model's loss over a text as bits per byte of that text.",
        _bits_cases,
        _bits_per_byte,
        ("bits (a number)",),
        ("bits_per_token", "nats_not_bits"),
    ),
    "composition_score": Exercise(
        "fn(w_qk, w_ov) -> score; w_qk and w_ov [d, d] -> a number",
        "||W_QK W_OV||_F / (||W_QK||_F ||W_OV||_F): how much of the later head's W_QK reads "
        "what the earlier head's W_OV writes.",
        _composition_cases,
        _composition,
        ("score (a number)",),
        ("composition_not_normalised", "composition_order_swapped"),
    ),
    "merge_partials": Exercise(
        "fn(out_a, lse_a, out_b, lse_b) -> (out, lse); out [..., T, Dv], lse [..., T]",
        "Two partial attentions over disjoint keys merged into one (eq. 19.1); L = -inf where a "
        "query saw no key in a part.",
        _merge_cases,
        _ref_merge,
        ("out [..., T, Dv]", "lse [..., T]"),
        ("merge_plain_average", "merge_without_max"),
    ),
    "ring_attention_simulated": Exercise(
        "fn(q, k, v, processes) -> out; q, k, v [B, H, T, D], T a multiple of processes",
        "Causal attention computed shard by shard: the keys in `processes` contiguous shards, "
        "each shard's partial (out, L) for every query, merged.",
        _ring_cases,
        _ring,
        ("out [B, H, T, D]",),
        ("ring_partials_averaged", "ring_empty_shard_nan"),
    ),
}


# ---- the checker ----------------------------------------------------------------------------


class _Fail(Exception):
    """A message for the reader; raised inside `check` and never leaves it."""


def _copy(args):
    return tuple(
        a.clone() if torch.is_tensor(a) else list(a) if isinstance(a, list) else a for a in args
    )


def _call(fn, args, label, ex: Exercise):
    """Call fn on copies of args; return its outputs as a tuple of float64 tensors."""
    given = _copy(args)
    try:
        out = fn(*given)
    except NotImplementedError:
        raise _Fail("not implemented yet (the function raises NotImplementedError).") from None
    except Exception as err:  # the reader's code may raise anything
        raise _Fail(f"your function raised {type(err).__name__}: {err} (case {label}).") from None
    names = ex.signature[3 : ex.signature.index(")")].split(", ")  # "fn(q, k, v) -> .."
    for name, a, b in zip(names, args, given):
        if torch.is_tensor(a) and (not torch.is_tensor(b) or not torch.equal(a, b)):
            raise _Fail(
                f"your function changed its input `{name}` in place; work on new tensors "
                f"(x = x * s, not x *= s) (case {label})."
            )
    want = len(ex.outputs)
    if want > 1:
        if not isinstance(out, (tuple, list)) or len(out) != want:
            raise _Fail(
                f"expected a tuple of {want} tensors ({', '.join(ex.outputs)}), "
                f"got {_describe(out)}."
            )
    else:
        out = (out,)
    result = []
    for o, name in zip(out, ex.outputs):
        if "(a number)" in name:
            result.append(_number(o, name))
            continue
        if not torch.is_tensor(o):
            raise _Fail(f"expected a torch.Tensor for {name}, got {type(o).__name__}.")
        if not o.is_floating_point():
            raise _Fail(f"expected a real floating-point tensor for {name}, got {o.dtype}.")
        result.append(o.detach().cpu().double())
    return tuple(result)


def _number(o, name: str) -> torch.Tensor:
    """A count the reader returned (int, float or one-element tensor) as a float64 scalar."""
    if torch.is_tensor(o) and o.numel() == 1 and not o.is_complex() and o.dtype != torch.bool:
        return o.detach().cpu().double().reshape(())
    if isinstance(o, (int, float)) and not isinstance(o, bool):
        return torch.tensor(float(o), dtype=torch.float64)
    raise _Fail(f"expected a number for {name.split()[0]}, got {type(o).__name__}.")


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def _close(outs, exps, nan_as_zero=False):
    if len(outs) != len(exps) or any(o.shape != e.shape for o, e in zip(outs, exps)):
        return False
    if nan_as_zero:
        outs, exps = (
            [x.nan_to_num(0.0, posinf=math.inf, neginf=-math.inf) for x in xs]
            for xs in (outs, exps)
        )
    return all(torch.allclose(o, e, RTOL, ATOL) for o, e in zip(outs, exps))


def _index(flat: int, shape) -> list:
    return list(torch.unravel_index(torch.tensor(flat), tuple(shape))) if shape else []


def _first_wrong(out, exp):
    bad = ~torch.isclose(out, exp, RTOL, ATOL)
    flat = int(bad.flatten().nonzero()[0])
    idx = [int(i) for i in _index(flat, out.shape)]
    return idx, float(out.flatten()[flat]), float(exp.flatten()[flat])


def _probe_finding(fn, name):
    """With v = identity attention returns its weights: name future keys and bad row sums."""
    probe = _probes().get(name)
    if probe is None:
        return None
    args, allowed = probe
    try:
        out = fn(*_copy(args))
        weights = out.detach().cpu().double()
        allowed = allowed.expand_as(weights)
        if weights.isnan().any() or (weights < -1e-4).any():  # these are not weights
            return None
    except Exception:
        return None
    leak = (weights.abs() > 1e-4) & ~allowed
    if leak.any():
        idx = [int(i) for i in _index(int(leak.flatten().nonzero()[0]), weights.shape)]
        i, j = idx[-2:]
        return (
            f"query {i} gives weight {float(weights[tuple(idx)]):.3g} to key {j}, which it "
            f"must not see (probed with v = identity, so the output is the weights)"
        )
    sums = weights.sum(-1)  # [..., T]
    off = ((sums - 1).abs() > 1e-3) & allowed.any(-1)
    if off.any():
        idx = [int(i) for i in _index(int(off.flatten().nonzero()[0]), sums.shape)]
        return (
            f"the weights of query {idx[-1]} sum to {float(sums[tuple(idx)]):.4g}, not 1 "
            f"(probed with v = identity, so the output is the weights)"
        )
    return None


def _shape_message(ex: Exercise, cases, outs, exps):
    """The first output whose shape differs from the reference's, as a message; else None.

    outs and exps hold one tuple of float64 tensors per case, in the order of ex.outputs.
    """
    for c, o, e in zip(cases, outs, exps):
        for got, want, what in zip(o, e, ex.outputs):
            if got.shape != want.shape:
                hint = (
                    " (the right axes in the wrong order?)"
                    if sorted(got.shape) == sorted(want.shape)
                    else ""
                )
                return (
                    f"{what.split()[0]} has shape {list(got.shape)}, expected "
                    f"{list(want.shape)} = {what.split(' ', 1)[1]}{hint} "
                    f"(case {c.label})."
                )
    return None


def _matching_bug(name: str, ex: Exercise, cases, outs):
    """The first of ex.bugs whose wrong version gives these outputs on every case; else None."""
    matches = [
        bug
        for bug in ex.bugs
        if all(
            _close(o, _as_tuple(_wrong(name, bug)(*c.args)), nan_as_zero=True)
            for c, o in zip(cases, outs)
        )
    ]
    return matches[0] if matches else None


def _nan_message(ex: Exercise, cases, outs):
    """Where the first NaN of the outputs is, as a message; else None."""
    for c, o in zip(cases, outs):
        for got, what in zip(o, ex.outputs):
            if got.isnan().any():
                idx = [int(i) for i in _index(int(got.isnan().flatten().nonzero()[0]), got.shape)]
                return (
                    f"{what.split()[0]} has NaN, first at {idx} (case {c.label}); a softmax "
                    "over a row that is all -inf gives NaN, and so does exp of a score too "
                    "large for the dtype (inf / inf)."
                )
    return None


def _wrong_entry(ex: Exercise, cases, outs, exps):
    """The first entry that differs from the reference (its index, value, expected); else None."""
    for c, o, e in zip(cases, outs, exps):
        for got, want, what in zip(o, e, ex.outputs):
            if not torch.allclose(got, want, RTOL, ATOL):
                idx, g, w = _first_wrong(got, want)
                return f"{what.split()[0]}{idx} is {g:.4g}, expected {w:.4g} (case {c.label})."
    return None


def _diagnose(fn, name, ex: Exercise, cases, outs):
    """The message for a wrong answer: a matching bug, else what is wrong and where."""
    exps = [_as_tuple(ex.reference(*c.args)) for c in cases]
    shape = _shape_message(ex, cases, outs, exps)
    if shape:
        return None, shape
    bug = _matching_bug(name, ex, cases, outs)
    if bug:
        return bug, f"looks like `{bug}`: {BUGS[bug].explanation} See {BUGS[bug].link}"
    nan = _nan_message(ex, cases, outs)
    if nan:
        return None, nan
    found = _probe_finding(fn, name)
    text = _wrong_entry(ex, cases, outs, exps)
    if text:
        return None, f"{found}; first wrong entry: {text}" if found else text
    return None, found or "the output differs from the reference."


def _as_tuple(x):
    xs = x if isinstance(x, (tuple, list)) else (x,)
    return tuple(t.double() if torch.is_tensor(t) else torch.tensor(float(t)).double() for t in xs)


def check(name: str, fn: Callable, extra=()) -> Result:
    """Run fn against exercise `name` (a key of EXERCISES); print one verdict and return it.

    fn has the exercise's signature (see EXERCISES[name].signature). `extra`: more argument
    tuples to try after the seeded cases. The Result holds passed, diagnosis (a key of BUGS when
    the answer reproduces that bug on every case, else None) and message.
    """
    if name not in EXERCISES:
        raise ValueError(f"no exercise {name!r}; the exercises are {', '.join(EXERCISES)}")
    ex = EXERCISES[name]
    passed, diagnosis = False, None
    try:
        if not callable(fn):
            raise _Fail(f"expected a function, got {type(fn).__name__}.")
        cases = ex.cases() + [Case(tuple(args), f"extra {i}") for i, args in enumerate(extra)]
        outs = [_call(fn, c.args, c.label, ex) for c in cases]
        if all(_close(o, _as_tuple(ex.reference(*c.args))) for c, o in zip(cases, outs)):
            passed, message = True, f"correct on all {len(cases)} cases."
        else:
            diagnosis, message = _diagnose(fn, name, ex, cases, outs)
    except _Fail as fail:
        message = str(fail)
    except Exception as err:  # the checker itself must never hand the reader a traceback
        message = f"could not check this answer ({type(err).__name__}: {err})."
    verdict = f"{name}: {'passed' if passed else 'not yet'}: {message}"
    print(textwrap.fill(verdict, 80, subsequent_indent="  "))  # the page's 80 columns
    return Result(passed, diagnosis, message)


__all__ = ["BUGS", "EXERCISES", "Bug", "Exercise", "Result", "check"]
