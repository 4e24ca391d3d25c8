"""FlashAttention's forward and backward as Triton kernels (chapter 17): eqs. 14.1-14.2, 16.1-16.5.

One program per (query block, batch x query head) runs chapter 14's tile loop over the key
blocks its queries can see (eq. 7.1 on the book's positions), and writes O and the log-sum-exp
L (16.5). The backward is chapter 16's, in two kernels without atomics: one program per (key
block, batch x KV head) sums dK and dV over its query blocks and the query heads of its group
(9.1), one program per (query block, batch x query head) sums dQ over its key blocks.

Without a CUDA GPU, importing this module sets TRITON_INTERPRET=1 (and, if triton was imported
before, as torch._dynamo does, wraps Triton's library kernels for the interpreter), and Triton
runs the kernels on CPU tensors with NumPy, block by block; with one, the same kernels compile
for the GPU. Import it only where Triton is wanted: `import attnlib` does not.
"""

import math
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # no GPU: Triton's interpreter, on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated
    if "triton" in sys.modules:  # imported already (torch._dynamo does), the interpreter off:
        from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
        from triton.runtime.jit import JITFunction  # noqa: E402

        # Triton's own library kernels (tl.max, tl.sum, ...) were decorated then, for a GPU:
        # wrap them for the interpreter, as decorating them now would have.
        _wrapped = {}
        for name in [name for name in sys.modules if name.startswith("triton.language")]:
            for attr, value in list(vars(sys.modules[name]).items()):
                if isinstance(value, JITFunction):
                    if id(value) not in _wrapped:
                        _wrapped[id(value)] = InterpretedFunction(value.fn)
                    setattr(sys.modules[name], attr, _wrapped[id(value)])

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ..attention import prepare  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2_E = 1.0 / math.log(2.0)  # e^x = 2^(x log2 e), as in attnlib/tiled.py (chapter 14)


@triton.jit
def _rows(PTR, idx, n, stride, feats, width):
    """Rows idx of an [n, width] matrix at PTR (last stride 1), as a block; 0 outside it."""
    inside = (idx[:, None] < n) & (feats[None, :] < width)
    return tl.load(PTR + idx[:, None] * stride + feats[None, :], mask=inside, other=0.0)


@triton.jit
def _store_rows(PTR, idx, n, stride, feats, width, block):
    """Write `block` to rows idx of an [n, width] matrix at PTR, in its dtype; none outside."""
    inside = (idx[:, None] < n) & (feats[None, :] < width)
    tl.store(
        PTR + idx[:, None] * stride + feats[None, :], block.to(PTR.dtype.element_ty), mask=inside
    )


@triton.jit
def _scores(
    q, k, qpos, kpos, rows, cols, T, S, scale2, CAUSAL: tl.constexpr, PRECISION: tl.constexpr
):
    """One tile of scores in base 2 (eq. 3.3 times log2 e), -inf where hidden (5.1, 7.1)."""
    z = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
    seen = (rows < T)[:, None] & (cols < S)[None, :]  # inside the matrices
    if CAUSAL:
        seen = seen & (kpos[None, :] <= qpos[:, None])  # eq. 7.1
    return tl.where(seen, z, float("-inf"))


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, LSE, QPOS, KPOS, KEND,  # tensors; KEND [B, nq]: keys a query block may need
    scale2,  # the scale of eq. 3.3 times log2(e): scores in base 2
    T, S, HQ, GROUP, D, DV, NQ,  # sizes; NQ query blocks per head
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,  # strides (last axis 1)
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0), tl.program_id(1)  # this program's query block, (b, h)
    b, h = bh // HQ, bh % HQ
    kv = h // GROUP  # eq. 9.1: query head h reads KV head h // (Hq / Hkv)
    K, V = K + b * skb + kv * skh, V + b * svb + kv * svh  # this KV head's [S, D], [S, Dv]
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query indices
    feats, vfeats = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = _rows(Q + b * sqb + h * sqh, rows, T, sqt, feats, D)  # [BLOCK_M, BLOCK_D]
    qpos = tl.load(QPOS + b * T + rows, mask=rows < T, other=0)
    m = tl.full([BLOCK_M], -3.0e38, tl.float32)  # running max m (14.1), finite
    ell = tl.zeros([BLOCK_M], tl.float32)  # running sum l (14.1)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # unnormalised output o~ (14.2)
    end = S
    if CAUSAL:  # key blocks from `end` on are wholly in the future (17.1)
        end = tl.load(KEND + b * NQ + block)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key indices
        k, v = _rows(K, cols, S, sks, feats, D), _rows(V, cols, S, svs, vfeats, DV)
        kpos = tl.load(KPOS + b * S + cols, mask=cols < S, other=0)
        z = _scores(q, k, qpos, kpos, rows, cols, T, S, scale2, CAUSAL, PRECISION)
        m_new = tl.maximum(m, tl.max(z, 1))  # m' (14.1)
        rescale = tl.exp2(m - m_new)  # e^{m - m'}
        a = tl.exp2(z - m_new[:, None])  # e^{z_j - m'}
        ell = ell * rescale + tl.sum(a, 1)  # l' (14.1)
        pv = tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * rescale[:, None] + pv  # o~' (14.2)
        m = m_new
    out = acc / tl.where(ell > 0, ell, 1.0)[:, None]  # o~ / l; a row that saw nothing: 0
    _store_rows(OUT + b * sob + h * soh, rows, T, sot, vfeats, DV, out)
    found = (m + tl.log2(tl.where(ell > 0, ell, 1.0))) / 1.4426950408889634  # 16.5
    lse = tl.where(ell > 0, found, float("inf"))  # natural log; +inf: saw no key
    tl.store(LSE + bh * T + rows, lse, mask=rows < T)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, QPOS, KPOS, QSTART,  # QSTART [B, nk]: first query needed
    scale2, scale,
    T, S, HQ, HKV, GROUP, D, DV, NK,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,  # dO shares O's strides
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    block, bkv = tl.program_id(0), tl.program_id(1)  # this program's key block, (b, kv head)
    b, kv = bkv // HKV, bkv % HKV
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    feats, vfeats = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = _rows(K + b * skb + kv * skh, cols, S, sks, feats, D)
    v = _rows(V + b * svb + kv * svh, cols, S, svs, vfeats, DV)
    kpos = tl.load(KPOS + b * S + cols, mask=cols < S, other=0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)  # this key block's dK and dV: summed here,
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)  # written once, no other program adds
    first = 0
    if CAUSAL:  # queries before `first` see none of these keys (17.2)
        first = tl.load(QSTART + b * NK + block)
    for g in range(0, GROUP):  # every query head of this KV head's group (9.1)
        h = kv * GROUP + g
        for start in range(first, T, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q = _rows(Q + b * sqb + h * sqh, rows, T, sqt, feats, D)
            do = _rows(DO + b * sdb + h * sdh, rows, T, sdt, vfeats, DV)
            lse = tl.load(LSE + (b * HQ + h) * T + rows, mask=rows < T, other=float("inf"))
            delta = tl.load(DELTA + (b * HQ + h) * T + rows, mask=rows < T, other=0.0)
            qpos = tl.load(QPOS + b * T + rows, mask=rows < T, other=0)
            z = _scores(q, k, qpos, kpos, rows, cols, T, S, scale2, CAUSAL, PRECISION)
            a = tl.exp2(z - lse[:, None] * 1.4426950408889634)  # A = e^{z - lse} (16.5)
            dv += tl.dot(tl.trans(a).to(do.dtype), do, input_precision=PRECISION)  # 16.1
            da = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dA = dO V^T (16.1)
            dz = a * (da - delta[:, None])  # dZ = A o (dA - delta) (16.3)
            dk += tl.dot(tl.trans(dz).to(q.dtype), q, input_precision=PRECISION)  # 16.4
    _store_rows(DK + b * skb + kv * skh, cols, S, sks, feats, D, dk * scale)
    _store_rows(DV_ + b * svb + kv * svh, cols, S, svs, vfeats, DV, dv)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, KEND,
    scale2, scale,
    T, S, HQ, GROUP, D, DV, NQ,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0), tl.program_id(1)  # the forward's grid
    b, h = bh // HQ, bh % HQ
    kv = h // GROUP
    K, V = K + b * skb + kv * skh, V + b * svb + kv * svh
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    feats, vfeats = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = _rows(Q + b * sqb + h * sqh, rows, T, sqt, feats, D)
    do = _rows(DO + b * sdb + h * sdh, rows, T, sdt, vfeats, DV)
    lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=float("inf"))
    delta = tl.load(DELTA + bh * T + rows, mask=rows < T, other=0.0)
    qpos = tl.load(QPOS + b * T + rows, mask=rows < T, other=0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = S
    if CAUSAL:
        end = tl.load(KEND + b * NQ + block)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k, v = _rows(K, cols, S, sks, feats, D), _rows(V, cols, S, svs, vfeats, DV)
        kpos = tl.load(KPOS + b * S + cols, mask=cols < S, other=0)
        z = _scores(q, k, qpos, kpos, rows, cols, T, S, scale2, CAUSAL, PRECISION)
        a = tl.exp2(z - lse[:, None] * 1.4426950408889634)  # 16.5
        da = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # 16.1
        dz = a * (da - delta[:, None])  # 16.3
        dq += tl.dot(dz.to(k.dtype), k, input_precision=PRECISION)  # dQ = scale dZ K (16.4)
    _store_rows(DQ + b * sqb + h * sqh, rows, T, sqt, feats, D, dq * scale)


def key_block_ends(query_positions, key_positions, block_m: int) -> torch.Tensor:
    """Per query block, how many keys it must read, int32 [B, nq]: one past the last key that
    eq. 7.1 shows to any of its queries (0 if none). The key blocks after it are skipped."""
    batch, queries = query_positions.shape
    pad = -queries % block_m  # padding rows see nothing
    padded = torch.nn.functional.pad(query_positions, (0, pad), value=-(2**62))
    newest = padded.view(batch, -1, block_m).amax(-1)  # [B, nq]: the block's largest position
    seen = key_positions[:, None, :] <= newest[:, :, None]  # [B, nq, S]
    index = torch.arange(1, key_positions.shape[1] + 1, device=seen.device)  # [S]
    ends = (seen * index).amax(-1) if index.numel() else torch.zeros_like(newest)
    return ends.to(torch.int32)


def query_starts(query_positions, key_positions, block_n: int) -> torch.Tensor:
    """Per key block, the first query that eq. 7.1 lets see any of its keys, int32 [B, nk]
    (T if none): the query blocks before it are skipped by the backward's dK, dV programs."""
    batch, keys = key_positions.shape
    pad = -keys % block_n
    padded = torch.nn.functional.pad(key_positions, (0, pad), value=2**62)
    oldest = padded.view(batch, -1, block_n).amin(-1)  # [B, nk]: the block's smallest position
    sees = query_positions[:, None, :] >= oldest[:, :, None]  # [B, nk, T]
    queries = query_positions.shape[1]
    first = torch.where(sees.any(-1), sees.to(torch.int8).argmax(-1), queries)
    return first.to(torch.int32)


def _sizes(q, k, v, block_m, block_n):
    batch, q_heads, queries, dim = q.shape
    kv_heads, keys, dim_v = k.shape[1], k.shape[2], v.shape[3]
    blocks = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(dim_v)),
    )
    return batch, q_heads, kv_heads, queries, keys, dim, dim_v, blocks


def _strides(*tensors):
    return [s for x in tensors for s in x.stride()[:3]]


def forward(q, k, v, prepared, block_m=32, block_n=32, precision="ieee"):
    """O [B, Hq, T, Dv] in q's dtype and L [B, Hq, T] (natural log, float32; +inf where a query
    sees no key), from the forward kernel; q, k, v contiguous, positions from `prepare`."""
    batch, q_heads, kv_heads, queries, keys, dim, dim_v, blocks = _sizes(q, k, v, block_m, block_n)
    out = q.new_empty(batch, q_heads, queries, dim_v)
    lse = torch.empty(batch, q_heads, queries, device=q.device, dtype=torch.float32)
    qpos, kpos = (x.to(torch.int64).contiguous() for x in prepared[:2])
    ends = key_block_ends(qpos, kpos, block_m).contiguous()
    grid = (triton.cdiv(queries, block_m), batch * q_heads)
    if queries and keys:
        _forward_kernel[grid](
            q, k, v, out, lse, qpos, kpos, ends, prepared.scale * LOG2_E,
            queries, keys, q_heads, q_heads // kv_heads, dim, dim_v, grid[0],
            *_strides(q, k, v, out), CAUSAL=prepared.causal, PRECISION=precision, **blocks,
        )  # fmt: skip
    else:  # nothing to attend to (or no query): zeros, L = +inf
        out.zero_(), lse.fill_(math.inf)
    return out, lse


def backward(d_out, q, k, v, out, lse, prepared, block_m=32, block_n=32, precision="ieee"):
    """dQ, dK, dV (eqs. 16.1-16.5) from dO [B, Hq, T, Dv] and the forward's O and L."""
    batch, q_heads, kv_heads, queries, keys, dim, dim_v, blocks = _sizes(q, k, v, block_m, block_n)
    d_out = d_out.contiguous()
    delta = (d_out.float() * out.float()).sum(-1).contiguous()  # [B, Hq, T], eq. 16.2
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if not (queries and keys):
        return dq, dk, dv
    qpos, kpos = (x.to(torch.int64).contiguous() for x in prepared[:2])
    sizes = (prepared.scale * LOG2_E, prepared.scale, queries, keys, q_heads)
    strides = _strides(q, k, v, d_out)
    options = dict(CAUSAL=prepared.causal, PRECISION=precision, **blocks)
    starts = query_starts(qpos, kpos, block_n).contiguous()
    grid = (triton.cdiv(keys, block_n), batch * kv_heads)
    _dkdv_kernel[grid](
        q, k, v, d_out, lse, delta, dk, dv, qpos, kpos, starts, *sizes,
        kv_heads, q_heads // kv_heads, dim, dim_v, grid[0], *strides, **options,
    )  # fmt: skip
    ends = key_block_ends(qpos, kpos, block_m).contiguous()
    grid = (triton.cdiv(queries, block_m), batch * q_heads)
    _dq_kernel[grid](
        q, k, v, d_out, lse, delta, dq, qpos, kpos, ends, *sizes,
        q_heads // kv_heads, dim, dim_v, grid[0], *strides, **options,
    )  # fmt: skip
    return dq, dk, dv


class TritonAttention(torch.autograd.Function):
    """The kernels for autograd: saves q, k, v, O and L [B, Hq, T], nothing T x S."""

    @staticmethod
    def forward(ctx, q, k, v, prepared, block_m, block_n, precision):
        out, lse = forward(q, k, v, prepared, block_m, block_n, precision)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (prepared, block_m, block_n, precision)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        grads = backward(d_out, *ctx.saved_tensors, *ctx.options)
        return *grads, None, None, None, None


def triton_attention(
    q,
    k,
    v,
    query_positions=None,
    key_positions=None,
    scale=None,
    causal=True,
    return_lse=False,
    block_m=32,
    block_n=32,
    precision="ieee",
):
    """`causal_attention` (eqs. 2.2, 7.1, 9.1) by the Triton kernels, differentiable (16.1-16.5).

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> O [B, Hq, T, Dv] in q's dtype, and
    with return_lse=True also L [B, Hq, T] (float32, -inf where a query sees no key; no
    gradient). block_m x block_n tiles, powers of 2 of at least 16. precision is tl.dot's
    input_precision on a GPU: "ieee" (float32 products) or "tf32" (10-bit mantissas).
    """
    prepared = prepare(q, k, v, query_positions, key_positions, None, scale, causal)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of 2 of at least 16, got {size!r}")
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision must be 'ieee' or 'tf32', got {precision!r}")
    if q.dtype == torch.float64:
        raise ValueError("the kernels take float32, float16 or bfloat16, got float64")
    if q.device.type == "cpu" and not INTERPRETED:
        raise ValueError("a CUDA GPU is present: move q, k and v to it (q.cuda())")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = TritonAttention.apply(q, k, v, prepared, block_m, block_n, precision)
    if return_lse:
        return out, lse.masked_fill(lse == math.inf, -math.inf)
    return out


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 x rounded to `bits` mantissa bits (nearest, ties to even), still float32: 10 is
    what TF32 keeps of float32's 23, 7 what bfloat16 keeps. Exponents are left as they are."""
    if x.dtype != torch.float32 or not 0 <= bits <= 23:
        raise ValueError(f"x must be float32 and bits in 0..23, got {x.dtype} and {bits}")
    drop = 23 - bits
    if drop == 0:
        return x.clone()
    raw = x.contiguous().view(torch.int32)
    odd = (raw >> drop) & 1  # ties go to the even neighbour
    rounded = (raw + (1 << (drop - 1)) - 1 + odd) & ~((1 << drop) - 1)
    return rounded.view(torch.float32)


def gpu_timing(lengths=(1024, 2048, 4096), heads=8, dim=64, causal=True, dtype=torch.float16):
    """On a CUDA GPU: milliseconds of the Triton forward and of SDPA at each T = S (B = 1,
    `heads` heads of `dim`), by triton.testing.do_bench; returns {T: (triton ms, SDPA ms)}.
    Without one it prints what it would time and returns None."""
    if not torch.cuda.is_available():
        print(
            "No CUDA GPU here, so nothing is timed. On a GPU this would time the Triton\n"
            f"forward against SDPA with triton.testing.do_bench, at T = S = "
            f"{', '.join(map(str, lengths))}:\n{heads} heads of {dim}, {dtype}, causal={causal}."
        )
        return None
    times = {}
    for length in lengths:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(1, heads, length, dim, device="cuda", dtype=dtype, generator=gen)
            for _ in range(3)
        )
        ours = triton.testing.do_bench(
            lambda q=q, k=k, v=v: triton_attention(q, k, v, causal=causal, block_m=128, block_n=64)
        )
        sdpa = triton.testing.do_bench(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        )
        times[length] = (ours, sdpa)
        print(f"T = {length:>6}: Triton {ours:.3f} ms, SDPA {sdpa:.3f} ms ({ours / sdpa:.2f}x)")
    return times
