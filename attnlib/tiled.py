"""Tiled attention with an online softmax, FlashAttention-style (eqs. 14.1-14.2), and its backward.

The same function as `causal_attention`, one [query block x key block] tile at a time, so the
[T, S] score matrix never exists, not even for training: the backward (eqs. 16.1-16.5)
recomputes each tile's weights from the per-row log-sum-exp L that the forward saves.
"""

import math

import torch
from torch.autograd.function import once_differentiable

from . import native
from .attention import Prepared, compute_dtype, prepare
from .masks import visible

LOG2_E = 1.0 / math.log(2.0)  # e^x = 2^(x log2 e): GPUs have a native exp2 (chapter 14)


def _block_bounds(positions: torch.Tensor, block: int):
    """Per block of `block` columns of positions [B, N]: (min, max) over the block, each [B, n]."""
    blocks = [positions[:, s : s + block] for s in range(0, positions.shape[1], block)]
    return torch.stack([b.amin(1) for b in blocks], 1), torch.stack([b.amax(1) for b in blocks], 1)


def _tile_states(prepared: Prepared, block: int) -> torch.Tensor:
    """Per tile, what eq. 7.1 hides, int8 [B, nq, nk]: 0 all of the tile, 2 none of it, 1 some."""
    q_low, q_high = _block_bounds(prepared.query_positions, block)  # [B, nq]
    k_low, k_high = _block_bounds(prepared.key_positions, block)  # [B, nk]
    hidden = k_low[:, None, :] > q_high[:, :, None]  # [B, nq, nk]
    shown = k_high[:, None, :] <= q_low[:, :, None]
    return torch.where(hidden, 0, torch.where(shown, 2, 1)).to(torch.int8)


def _tiles(prepared: Prepared, block: int):
    """Per query block: (i0, i1, its key tiles (j0, j1, mask)), leaving out the tiles that eq. 7.1
    and `allowed` hide; mask: None if all is visible, else boolean [B or 1, Hq or 1, t, s]."""
    query_pos, key_pos, allowed = prepared[:3]
    queries, keys = query_pos.shape[1], key_pos.shape[1]
    if queries == 0 or keys == 0:
        return
    if allowed is not None:  # a view with stride 0 on broadcast axes, so any slice of it works
        allowed = allowed.expand(*allowed.shape[:2], queries, keys)  # [B or 1, Hq or 1, T, S]
    states = _tile_states(prepared, block)  # [B, nq, nk]
    hidden, shown = (states == 0).all(0).tolist(), (states == 2).all(0).tolist()  # [nq][nk]

    def key_tiles(qi, i0, i1):
        for kj in [kj for kj, hides in enumerate(hidden[qi]) if not hides]:
            j0, j1 = kj * block, min(kj * block + block, keys)
            mask = None if shown[qi][kj] else visible(query_pos[:, i0:i1], key_pos[:, j0:j1])
            extra = None if allowed is None else allowed[..., i0:i1, j0:j1]  # [B|1, Hq|1, t, s]
            if extra is not None and not bool(extra.all()):
                mask = extra if mask is None else mask & extra
            if mask is None or bool(mask.any()):
                yield j0, j1, mask

    for qi, i0 in enumerate(range(0, queries, block)):
        i1 = min(i0 + block, queries)
        yield i0, i1, key_tiles(qi, i0, i1)


def _scores(q_tile: torch.Tensor, k_tile: torch.Tensor, mask) -> torch.Tensor:
    """One tile of scores (eq. 3.3), [B, Hkv, g*t, s], -inf where the mask hides the key (5.1)."""
    scores = q_tile @ k_tile.transpose(-2, -1)  # [B, Hkv, g*t, s]
    if mask is not None:  # mask [B|1, Hq|1, t, s]: split its heads as Hkv x g, like the scores
        heads = (-1, scores.shape[2] // mask.shape[2] if mask.shape[1] > 1 else 1)
        grouped = scores.view(*scores.shape[:2], -1, *mask.shape[2:])  # [B, Hkv, g, t, s]
        grouped.masked_fill_(~mask.unflatten(1, heads), -math.inf)
    return scores


def _compiled_arrays(q, k, v, prepared: Prepared, block: int):
    """What attnlib/csrc/tiled.cpp reads, contiguous: q in base 2, k, v (compute dtype), the
    positions, `allowed` [B, Hq, T, S] (0-strided where it broadcasts), its strides, the tile
    states of eq. 7.1 and the sizes."""
    work, (batch, q_heads, queries, dim) = compute_dtype(q.dtype), q.shape
    q2 = (q.to(work) * (prepared.scale * LOG2_E)).contiguous()  # base 2, as in the torch inner
    k, v = k.to(work).contiguous(), v.to(work).contiguous()
    positions = [x.to(torch.int64).contiguous() for x in prepared[:2]]  # [B, T], [B, S]
    allowed, keys = prepared.allowed, k.shape[2]
    if allowed is not None:
        allowed = allowed.expand(batch, q_heads, queries, keys)  # strides 0 where broadcast
    strides = torch.tensor([0] * 4 if allowed is None else allowed.stride(), dtype=torch.int64)
    states = _tile_states(prepared, block).contiguous()  # [B, nq, nk]
    sizes = torch.tensor([batch, q_heads, k.shape[1], queries, keys, dim, v.shape[3]])
    return q2, k, v, positions, allowed, strides, states, sizes


def _pointers(*tensors):
    return [None if x is None else x.data_ptr() for x in tensors]


def _compiled_forward(q, k, v, prepared: Prepared, block: int, with_lse: bool):
    """_forward's result from attnlib/csrc/tiled.cpp: every tile of eqs. 14.1-14.2, from the
    first matmul to the last, in one core's cache; the matmuls by torch's BLAS."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return _forward(q, k, v, prepared, block, with_lse)  # nothing to point at
    q2, k, v, positions, allowed, strides, states, sizes = _compiled_arrays(
        q, k, v, prepared, block
    )
    out = q2.new_empty(*q.shape[:3], v.shape[3])  # [B, Hq, T, Dv]
    lse = q2.new_empty(q.shape[:3]) if with_lse else None  # [B, Hq, T]
    double, threads = q2.dtype == torch.float64, torch.get_num_threads()
    arrays = (q2, k, v, *positions, allowed, strides, states, out, lse, sizes)
    native.tile_kernels("tiled_forward")[double](
        *_pointers(*arrays), block, threads, native.blas()[double]
    )
    return out.to(q.dtype), lse


def _compiled_backward(grad, grad_lse, q, k, v, out, lse, prepared: Prepared, block: int):
    """_backward's result from attnlib/csrc/tiled.cpp: eqs. 16.1-16.5 per KV head, each tile's
    A and dZ kept in one core's cache; every sum in one fixed order (deterministic)."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return _backward(grad, grad_lse, q, k, v, out, lse, prepared, block)
    q2, k2, v2, positions, allowed, strides, states, sizes = _compiled_arrays(
        q, k, v, prepared, block
    )
    work, threads = q2.dtype, torch.get_num_threads()
    delta = _delta(grad, grad_lse, out, work).contiguous()
    grad, lse2 = grad.to(work).contiguous(), (lse * LOG2_E).contiguous()  # L in base 2
    dq, dk, dv = torch.zeros_like(q2), torch.zeros_like(k2), torch.zeros_like(v2)
    arrays = (q2, k2, v2, grad, lse2, delta, *positions, allowed, strides, states, dq, dk, dv,
              sizes)  # fmt: skip
    double = work == torch.float64
    native.tile_kernels("tiled_backward")[double](
        *_pointers(*arrays), block, threads, native.blas()[double]
    )
    dq, dk = dq.mul_(prepared.scale), dk.div_(LOG2_E)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def _forward(q, k, v, prepared: Prepared, block: int, with_lse: bool, inner="torch"):
    """Eqs. 14.1-14.2 by tiles: O [B, Hq, T, Dv] in q's dtype and, if asked, L [B, Hq, T] (16.5)."""
    if inner == "cpp":
        return _compiled_forward(q, k, v, prepared, block, with_lse)
    group, work = q.shape[1] // k.shape[1], compute_dtype(q.dtype)  # eq. 9.1: h = kv*g + r
    q, k, v = q.unflatten(1, (-1, group)), k.to(work), v.to(work)  # [B, Hkv, g, T, D]
    out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=work)  # [B, Hkv, g, T, Dv]
    lse = q.new_full(q.shape[:-1], math.inf, dtype=work) if with_lse else None  # [B, Hkv, g, T]
    for i0, i1, tiles in _tiles(prepared, block):
        # Scores in base 2: e^s = 2^(s log2 e), with log2 e folded into the queries.
        q_tile = (q[:, :, :, i0:i1].to(work) * (prepared.scale * LOG2_E)).flatten(2, 3)
        # Running max m, [B, Hkv, g*t, 1], from the lowest finite float rather than -inf, so that
        # a row that has seen no key yet gets e^{m - m'} = 1 and e^{-inf - m'} = 0, never NaN.
        m = q_tile.new_full((*q_tile.shape[:3], 1), torch.finfo(work).min)
        ell = q_tile.new_zeros(*q_tile.shape[:3], 1)  # running sum l
        o = q_tile.new_zeros(*q_tile.shape[:3], v.shape[-1])  # accumulator o, [B, Hkv, g*t, Dv]
        for j0, j1, mask in tiles:
            scores = _scores(q_tile, k[:, :, j0:j1], mask)  # [B, Hkv, g*t, s]
            new_m = torch.maximum(m, scores.amax(-1, keepdim=True))  # eq. 14.1: m'
            rescale = torch.exp2(m - new_m)  # e^{m - m'}
            weights = scores.sub_(new_m).exp2_()  # e^{s_j - m'}
            ell.mul_(rescale).add_(weights.sum(-1, keepdim=True))  # eq. 14.1: l'
            m = new_m
            o.mul_(rescale).add_(weights @ v[:, :, j0:j1])  # eq. 14.2: o'
        o /= ell.masked_fill(ell == 0, 1.0)  # o / l; a row that saw nothing stays 0
        out[:, :, :, i0:i1] = o.unflatten(2, (group, -1))
        if with_lse:  # L = m + log l (back from base 2); +inf for a row that sees no key
            found = torch.where(ell > 0, (m + ell.log2()) / LOG2_E, math.inf)  # [B, Hkv, g*t, 1]
            lse[:, :, :, i0:i1] = found.squeeze(-1).unflatten(2, (group, -1))
    return out.flatten(1, 2).to(q.dtype), None if lse is None else lse.flatten(1, 2)


def _delta(grad, grad_lse, out, work) -> torch.Tensor:
    """delta = rowsum(dO o O) (eq. 16.2) less dL, [B, Hq, T]; only rows that saw a key matter."""
    delta = (grad.to(work) * out.to(work)).sum(-1)
    return delta - grad_lse.to(work).nan_to_num(0.0, 0.0, 0.0)


def _backward(grad, grad_lse, q, k, v, out, lse, prepared: Prepared, block: int):
    """Eqs. 16.1-16.4 by tiles: dQ, dK, dV from dO [B, Hq, T, Dv]; each tile's A from lse (16.5).

    A gradient dlse [B, Hq, T] of the log-sum-exp adds A * dlse to dZ (dlse/dZ = A): delta - dlse.
    """
    group, work, scale = q.shape[1] // k.shape[1], compute_dtype(q.dtype), prepared.scale
    delta = _delta(grad, grad_lse, out, work)
    per_query = (q.to(work) * (scale * LOG2_E), grad.to(work), lse * LOG2_E, delta)  # base 2
    q2, grad, lse, delta = (x.unflatten(1, (-1, group)) for x in per_query)  # [B, Hkv, g, T, .]
    k, v = k.to(work), v.to(work)  # [B, Hkv, S, D], [B, Hkv, S, Dv]
    dq, dk, dv = torch.zeros_like(q2), torch.zeros_like(k), torch.zeros_like(v)
    for i0, i1, tiles in _tiles(prepared, block):
        q_tile, do = (x[:, :, :, i0:i1].flatten(2, 3) for x in (q2, grad))  # [B, Hkv, g*t, D|Dv]
        row_lse, row_delta = (x[:, :, :, i0:i1].flatten(2, 3)[..., None] for x in (lse, delta))
        for j0, j1, mask in tiles:
            p = _scores(q_tile, k[:, :, j0:j1], mask).sub_(row_lse).exp2_()  # eq. 16.5: A
            dv[:, :, j0:j1] += p.transpose(-2, -1) @ do  # eq. 16.1: dV = A^T dO, summed over g
            ds = (do @ v[:, :, j0:j1].transpose(-2, -1)).sub_(row_delta).mul_(p)  # eq. 16.3
            dq[:, :, :, i0:i1] += (ds @ k[:, :, j0:j1]).unflatten(2, (group, -1))  # eq. 16.4
            dk[:, :, j0:j1] += ds.transpose(-2, -1) @ q_tile  # eq. 16.4, q_tile holds the scale
    dq, dk = dq.mul_(scale).flatten(1, 2), dk.div_(LOG2_E)  # [B, Hq, T, D], [B, Hkv, S, D]
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


class _TiledAttention(torch.autograd.Function):
    """Tiled attention for autograd: it saves q, k, v, O and L [B, Hq, T], nothing T x S."""

    @staticmethod
    def forward(ctx, q, k, v, prepared: Prepared, block: int, inner: str):
        out, lse = _forward(q, k, v, prepared, block, with_lse=True, inner=inner)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prepared, ctx.block, ctx.inner = prepared, block, inner
        return out, _natural(lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_lse):
        backward = _compiled_backward if ctx.inner == "cpp" else _backward
        grads = backward(grad, grad_lse, *ctx.saved_tensors, ctx.prepared, ctx.block)
        return *grads, None, None, None


def _natural(lse: torch.Tensor) -> torch.Tensor:
    """L as a reader expects it: the log of a sum of nothing is -inf (inside, +inf zeroes P)."""
    return lse.masked_fill(lse == math.inf, -math.inf)


def tiled_attention(
    q,
    k,
    v,
    query_positions=None,
    key_positions=None,
    allowed=None,
    scale=None,
    block_size=256,
    return_lse=False,
    inner="torch",
):
    """`causal_attention` (eq. 2.2 with 7.1, 9.1) by online softmax over key blocks (14.1-14.2).

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, Hq, T, Dv] in q's dtype, with
    `causal_attention`'s arguments; block_size x block_size tiles; differentiable (16.1-16.5).
    return_lse=True also returns L (eq. 16.5, natural log) [B, Hq, T] in the compute dtype, -inf
    for a query that sees no key; gradients flow through both. inner="cpp" runs the forward
    and the backward compiled (attnlib/csrc/tiled.cpp), each tile kept in one core's cache.
    """
    prepared = prepare(q, k, v, query_positions, key_positions, allowed, scale)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer of at least 1, got {block_size!r}")
    if inner not in ("torch", "cpp"):
        raise ValueError(f"inner must be 'torch' or 'cpp', got {inner!r}")
    if inner == "cpp":
        if q.device.type != "cpu":
            raise ValueError(f"inner='cpp' runs on the CPU; q, k and v are on {q.device}")
        native.tile_kernels("tiled_forward")  # or, without g++, native's one-line message
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _TiledAttention.apply(q, k, v, prepared, block_size, inner)
        return (out, lse) if return_lse else out
    out, lse = _forward(q, k, v, prepared, block_size, return_lse, inner)  # no graph
    return (out, _natural(lse)) if return_lse else out
