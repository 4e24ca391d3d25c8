"""Multi-head latent attention (MLA), derived in chapter 23: the cache holds a latent per token.

Rows are tokens, as in eq. 2.1. A token's hidden vector x [d_model] is compressed to a latent
c_KV = RMSNorm(x W_DKV) of d_C numbers (eq. 23.1) and a rotary key k_R = RoPE(x W_KR) of d_R
numbers shared by every head (eq. 23.6); only these d_C + d_R numbers are cached (eq. 23.3).
Head h expands them into its key [c_KV W_UK^(h) | k_R] and value c_KV W_UV^(h) (eq. 23.1), or,
at decode, folds W_UK into the query and W_UV into the output projection (eqs. 23.4, 23.7) and
attends over the latents directly: multi-query attention with one head of width d_C + d_R.

Shapes: x [B, T, d_model]; latents [B, S, d_C]; rotary keys [B, S, d_R]; per-head maps W_UK
[H, d_C, Dn], W_UV [H, d_C, Dv], W_O [H, Dv, d_model]. Float64 stays float64 throughout.
"""

import math
from typing import NamedTuple, Optional, Tuple

import torch

from .attention import causal_attention, compute_dtype
from .rope import rotate_half


class MLAWeights(NamedTuple):
    """The maps of one MLA layer, written for rows (x W), eqs. 23.1-23.2 and 23.6."""

    w_dq: Optional[torch.Tensor]  # [d_model, d_q]; None: no query compression
    gain_q: Optional[torch.Tensor]  # [d_q], the query latent's RMSNorm gains
    w_uq: torch.Tensor  # [d_q or d_model, H, Dn + d_R]: each head's q_C and q_R
    w_dkv: torch.Tensor  # [d_model, d_C]
    gain_kv: torch.Tensor  # [d_C], the latent's RMSNorm gains
    w_kr: torch.Tensor  # [d_model, d_R]: the decoupled rotary key, one for all heads
    w_uk: torch.Tensor  # [H, d_C, Dn]
    w_uv: torch.Tensor  # [H, d_C, Dv]
    w_o: torch.Tensor  # [H, Dv, d_model]
    eps: float = 1e-6
    theta: float = 10000.0
    interleaved: bool = True  # DeepSeek's RoPE pairs features (2f, 2f+1), eq. 8.5

    @property
    def heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def nope_dim(self) -> int:
        return self.w_uk.shape[2]

    @property
    def rope_dim(self) -> int:
        return self.w_kr.shape[1]

    @property
    def latent_dim(self) -> int:
        return self.w_dkv.shape[1]

    def to(self, dtype: torch.dtype) -> "MLAWeights":
        return self._replace(
            **{
                name: None if value is None else value.to(dtype)
                for name, value in self._asdict().items()
                if isinstance(value, torch.Tensor) or value is None
            }
        )


def mla_scale(weights: MLAWeights) -> float:
    """Eq. 23.6's scale: 1/sqrt(Dn + d_R), the width of the whole key (its two parts)."""
    return 1.0 / math.sqrt(weights.nope_dim + weights.rope_dim)


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis (chapter 12): x / sqrt(mean(x^2) + eps) * gain."""
    work = compute_dtype(x.dtype)
    x32 = x.to(work)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return gain * normed.to(x.dtype)


def rope_rows(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool):
    """Eq. 8.4 on x [B, H, T, d_R] at positions [T] or [B, T], angles in x's precision.

    interleaved=True (DeepSeek's layout): features (2f, 2f+1) form a pair; they are first
    renumbered to the rotate-half layout, eq. 8.5, so the output is in that layout."""
    width = x.shape[-1]
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)  # eq. 8.5: pairs -> halves
    work = compute_dtype(x.dtype)
    inv_freq = 1.0 / theta ** (torch.arange(0, width, 2, dtype=work) / width)  # eq. 8.3
    angles = positions.to(work)[..., None] * inv_freq  # [(B,) T, d_R/2]
    angles = torch.cat((angles, angles), dim=-1)  # [(B,) T, d_R]
    if angles.dim() == 3:
        angles = angles[:, None]  # [B, 1, T, d_R]: one angle per token, every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


def latents(x: torch.Tensor, w: MLAWeights, positions: torch.Tensor):
    """What MLA caches for tokens x [B, T, d_model]: c_KV [B, T, d_C] (eq. 23.1) and the
    rotary key k_R [B, T, d_R] (eq. 23.6), already turned to its position."""
    c = rms_norm(x @ w.w_dkv, w.gain_kv, w.eps)  # [B, T, d_C]
    k_r = rope_rows((x @ w.w_kr)[:, None], positions, w.theta, w.interleaved)[:, 0]
    return c, k_r


def queries(x: torch.Tensor, w: MLAWeights, positions: torch.Tensor):
    """Eq. 23.2: q_C [B, H, T, Dn] and the turned q_R [B, H, T, d_R] of tokens x [B, T, d_model]."""
    c_q = x if w.w_dq is None else rms_norm(x @ w.w_dq, w.gain_q, w.eps)  # [B, T, d_q]
    q = torch.einsum("btq,qhd->bhtd", c_q, w.w_uq)  # [B, H, T, Dn + d_R]
    q_c, q_r = q.split([w.nope_dim, w.rope_dim], dim=-1)
    return q_c, rope_rows(q_r, positions, w.theta, w.interleaved)


def expand(c: torch.Tensor, k_r: torch.Tensor, w: MLAWeights):
    """Eq. 23.1 for every cached token: keys [B, H, S, Dn + d_R] = [c W_UK^(h) | k_R] and
    values [B, H, S, Dv] = c W_UV^(h)."""
    k_c = torch.einsum("bsc,hcd->bhsd", c, w.w_uk)  # [B, H, S, Dn]
    k_rope = k_r[:, None].expand(-1, w.heads, -1, -1)  # [B, H, S, d_R], shared by the heads
    v = torch.einsum("bsc,hcd->bhsd", c, w.w_uv)  # [B, H, S, Dv]
    return torch.cat((k_c, k_rope), dim=-1), v


class LatentCache:
    """The book's KVCache (chapter 10) for MLA: one row [c_KV | k_R] of d_C + d_R numbers per
    token (eq. 23.3), rows [B, S, d_C + d_R], and positions [S] or [B, S]."""

    def __init__(self, latent_dim: int) -> None:
        self.latent_dim = latent_dim
        self.rows: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.rows is None else self.rows.shape[1]

    @property
    def latents(self) -> torch.Tensor:
        """c_KV of every cached token, [B, S, d_C] (a view of the rows)."""
        return self.rows[..., : self.latent_dim]

    @property
    def rope_keys(self) -> torch.Tensor:
        """k_R of every cached token, [B, S, d_R] (a view of the rows)."""
        return self.rows[..., self.latent_dim :]

    def append(self, c: torch.Tensor, k_r: torch.Tensor, positions: torch.Tensor):
        """Add T new latents [B, T, d_C], rotary keys [B, T, d_R] and positions [T] or [B, T];
        return all cached rows [B, S + T, d_C + d_R] and positions."""
        if c.shape[-1] != self.latent_dim:
            raise ValueError(f"latents have {c.shape[-1]} numbers, the cache {self.latent_dim}")
        if c.shape[1] != k_r.shape[1] or c.shape[1] != positions.shape[-1]:
            raise ValueError(
                f"{c.shape[1]} latents, {k_r.shape[1]} rotary keys and "
                f"{positions.shape[-1]} positions must agree"
            )
        rows = torch.cat((c, k_r), dim=-1)  # [B, T, d_C + d_R]
        if self.rows is None:
            self.rows, self.positions = rows, positions
        else:
            self.rows = torch.cat([self.rows, rows], dim=1)  # [B, S+T, d_C + d_R]
            self.positions = torch.cat([self.positions, positions], dim=-1)
        return self.rows, self.positions

    def nbytes(self) -> int:
        """Bytes of the cached rows (positions are bookkeeping, left out)."""
        return 0 if self.rows is None else self.rows.numel() * self.rows.element_size()


def _step(x, w, cache, positions):
    """Queries of x, and the rows [c_KV | k_R] of every token once x's are appended."""
    tokens, cached = x.shape[1], 0 if cache is None else len(cache)
    if positions is None:
        positions = torch.arange(cached, cached + tokens, device=x.device)
    q_c, q_r = queries(x, w, positions)
    c, k_r = latents(x, w, positions)
    if cache is None:
        return q_c, q_r, torch.cat((c, k_r), dim=-1), positions, positions
    rows, key_positions = cache.append(c, k_r, positions)
    return q_c, q_r, rows, positions, key_positions


def naive_attention(q_c, q_r, rows, w: MLAWeights, qpos=None, kpos=None, allowed=None):
    """Eqs. 23.1, 23.6 over cached rows [B, S, d_C + d_R]: expand every row into each head's
    key and value, then causal attention (eqs. 2.2, 7.1) and W_O (eq. 6.2). q_c [B, H, T, Dn]
    and the turned q_R [B, H, T, d_R] -> [B, T, d_model]."""
    k, v = expand(*rows.split([w.latent_dim, w.rope_dim], dim=-1), w)  # [B, H, S, *]
    q = torch.cat((q_c, q_r), dim=-1)  # [B, H, T, Dn + d_R]
    o = causal_attention(q, k, v, qpos, kpos, allowed=allowed, scale=mla_scale(w))
    return torch.einsum("bhtd,hdm->btm", o, w.w_o)  # [B, T, d_model], eq. 6.2


def absorbed_attention(
    q_c, q_r, rows, w: MLAWeights, qpos=None, kpos=None, allowed=None, w_ov=None
):
    """Eqs. 23.4, 23.6, 23.7 over cached rows [B, S, d_C + d_R]; no key or value is expanded.

    Every head's absorbed query [q_C W_UK^(h)T | q_R] attends to one shared key head, the rows,
    and one value head, their latents: multi-query attention (eq. 9.1 with H_kv = 1), run as
    H*T queries of one head so that no row is copied per head. Then o_C W_UV^(h) W_O^(h),
    summed over heads (w_ov: folded_output(w), computed once). Returns [B, T, d_model]."""
    q = absorbed_query(q_c, q_r, w)  # [B, H, T, d_C + d_R]
    batch, heads, tokens, _ = q.shape
    if qpos is None:
        qpos = torch.arange(rows.shape[1] - tokens, rows.shape[1], device=q.device)
    qpos = torch.as_tensor(qpos, device=q.device).expand(batch, tokens).repeat(1, heads)
    o_c = causal_attention(
        q.reshape(batch, 1, heads * tokens, -1),  # [B, 1, H*T, d_C + d_R]
        rows[:, None],  # keys [B, 1, S, d_C + d_R]
        rows[:, None, :, : w.latent_dim],  # values: the latents, [B, 1, S, d_C]
        qpos,
        kpos,
        allowed=None if allowed is None else _per_head(allowed, heads, tokens),
        scale=mla_scale(w),
    ).view(batch, heads, tokens, -1)  # [B, H, T, d_C]
    w_ov = folded_output(w) if w_ov is None else w_ov
    return torch.einsum("bhtc,hcm->btm", o_c, w_ov)  # [B, T, d_model]


def _per_head(allowed: torch.Tensor, heads: int, tokens: int) -> torch.Tensor:
    """A mask [B, 1 or H, T or 1, S] for H*T queries of one head: [B, 1, H*T, S]."""
    batch, keys = allowed.shape[0], allowed.shape[-1]
    full = allowed.expand(batch, heads, tokens, keys)
    return full.reshape(batch, 1, heads * tokens, keys)


def mla_naive(
    x: torch.Tensor,
    w: MLAWeights,
    cache: Optional[LatentCache] = None,
    positions: Optional[torch.Tensor] = None,
    allowed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """An MLA layer as defined: x [B, T, d_model] -> [B, T, d_model]. Its latents join `cache`,
    then every cached row is expanded (naive_attention). positions [T] or [B, T] (default: after
    the cache); allowed: a boolean mask broadcastable to [B, H, T, S] (padding)."""
    q_c, q_r, rows, qpos, kpos = _step(x, w, cache, positions)
    return naive_attention(q_c, q_r, rows, w, qpos, kpos, allowed)


def mla_absorbed(
    x: torch.Tensor,
    w: MLAWeights,
    cache: Optional[LatentCache] = None,
    positions: Optional[torch.Tensor] = None,
    allowed: Optional[torch.Tensor] = None,
    w_ov: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The same layer over the latents (absorbed_attention); same arguments as mla_naive."""
    q_c, q_r, rows, qpos, kpos = _step(x, w, cache, positions)
    return absorbed_attention(q_c, q_r, rows, w, qpos, kpos, allowed, w_ov)


def absorbed_query(q_c: torch.Tensor, q_r: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """Eq. 23.4 then 23.6: [q_C W_UK^(h)T | q_R], [B, H, T, d_C + d_R]: a query over latents."""
    return torch.cat((torch.einsum("bhtd,hcd->bhtc", q_c, w.w_uk), q_r), dim=-1)


def folded_output(w: MLAWeights) -> torch.Tensor:
    """Eq. 23.7: W_UV^(h) W_O^(h) for every head, [H, d_C, d_model]."""
    return torch.einsum("hcd,hdm->hcm", w.w_uv, w.w_o)


def rope_before_absorption(x: torch.Tensor, w: MLAWeights) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chapter 23's counter-example: RoPE on the whole up-projected key, one head, no k_R.

    Returns the true scores q R_i . (c W_UK) R_j [B, T, T] and those of absorbing anyway,
    (q R_i W_UK^T) . c, which would need R_j inside the fold (eq. 23.5). Head 0 of W_UK; the
    queries are x's own q_C, turned at positions 0..T-1 (Dn must be even)."""
    tokens = x.shape[1]
    positions = torch.arange(tokens, device=x.device)
    q_c, _ = queries(x, w, positions)
    c, _ = latents(x, w, positions)
    q = rope_rows(q_c[:, :1], positions, w.theta, False)[:, 0]  # [B, T, Dn]
    k = rope_rows((c @ w.w_uk[0])[:, None], positions, w.theta, False)[:, 0]  # [B, T, Dn]
    true = q @ k.transpose(-2, -1)  # [B, T, T]
    absorbed = (q @ w.w_uk[0].transpose(0, 1)) @ c.transpose(-2, -1)  # [B, T, T]
    return true, absorbed
