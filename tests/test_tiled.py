import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib import causal_attention, left_padding, sliding_window, tiled_attention
from attnlib.cost import score_matrix_bytes
from attnlib.lab.checks import CountMatmuls
from attnlib.lab.memory import peak_allocated_bytes

from .references import bottom_right_mask, brute_force, sdpa


def _qkv(batch, q_heads, kv_heads, queries, keys, dim, value_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, queries, dim, generator=gen)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    v = torch.randn(batch, kv_heads, keys, value_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16, 512])
def test_matches_sdpa_with_bottom_right_mask_gqa_and_cache(block_size):
    q, k, v = _qkv(2, 6, 2, 5, 13, 8, 8)
    query_pos, key_pos = torch.arange(8, 13).expand(2, 5), torch.arange(13).expand(2, 13)
    expected = sdpa(q, k, v, bottom_right_mask(query_pos, key_pos))
    assert torch.allclose(tiled_attention(q, k, v, block_size=block_size), expected, atol=1e-5)


def test_matches_float64_brute_force_with_positions_window_and_scale():
    q, k, v = _qkv(2, 4, 2, 6, 9, 5, 3, torch.float64, seed=1)
    query_pos = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])
    key_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 5, 6, 7, 9, 10, 11]])
    window = sliding_window(query_pos, key_pos, 3)  # [B, 1, T, S]
    got = tiled_attention(q, k, v, query_pos, key_pos, allowed=window, scale=0.3, block_size=2)
    expected = brute_force(q, k, v, query_pos, key_pos, window, scale=0.3)
    assert got.dtype == torch.float64  # float64 stays float64
    assert torch.allclose(got, expected, atol=1e-12)


def test_equals_causal_attention_on_a_multi_head_layer_input():
    x = torch.randn(2, 40, 4 * 16, generator=torch.Generator().manual_seed(2))
    q = x.view(2, 40, 4, 16).transpose(1, 2)  # non-contiguous [B, H, T, D], as split_heads gives
    assert torch.allclose(
        tiled_attention(q, q, q, block_size=7), causal_attention(q, q, q), atol=1e-5
    )


def test_rows_that_see_no_key_are_zeros():
    q, k, v = _qkv(3, 2, 1, 6, 6, 4, 4)
    positions, allowed = left_padding([6, 2, 0], 6)  # row 1 has 4 pads, row 2 is all pads
    got = tiled_attention(q, k, v, positions, positions, allowed=allowed, block_size=2)
    assert torch.equal(got[1, :, :4], torch.zeros(2, 4, 4))
    assert torch.equal(got[2], torch.zeros(2, 6, 4))
    expected = causal_attention(q, k, v, positions, positions, allowed=allowed)
    assert torch.allclose(got, expected, atol=1e-5)
    early = tiled_attention(q, k, v, query_positions=torch.arange(-6, 0))  # before every key
    assert torch.equal(early, torch.zeros_like(early))


def test_hidden_key_blocks_are_never_read():
    # NaN in the values of keys 4..7: a query block that reads them turns NaN (0 * NaN = NaN).
    q, k, v = _qkv(1, 2, 2, 8, 8, 4, 4)
    v[:, :, 4:] = float("nan")
    assert torch.isnan(causal_attention(q, k, v)[:, :, :4]).all()  # naive multiplies by 0
    got = tiled_attention(q, k, v, block_size=4)
    assert torch.isfinite(got[:, :, :4]).all()  # queries 0..3 skipped the hidden block
    clean = causal_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4])
    assert torch.allclose(got[:, :, :4], clean, atol=1e-6)
    allowed = torch.ones(8, 8, dtype=torch.bool)
    allowed[:, 4:] = False  # the same keys hidden by `allowed` alone (no causal rule: positions)
    got = tiled_attention(q, k, v, torch.full((8,), 9), allowed=allowed, block_size=4)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize(
    "window, expected_tiles",
    [(None, 4 + 3 + 2 + 1), (256, 4 + 3)],  # causal: a triangle; window 256: the diagonal band
)
def test_skips_hidden_tiles(window, expected_tiles):
    q, k, v = _qkv(1, 2, 2, 1024, 1024, 8, 8)
    allowed = (
        None if window is None else sliding_window(torch.arange(1024), torch.arange(1024), window)
    )
    with CountMatmuls() as counter:
        tiled_attention(q, k, v, allowed=allowed, block_size=256)
    assert counter.count == 2 * expected_tiles  # one score and one output matmul per tile


def test_memory_is_linear_not_quadratic():
    q, k, v = _qkv(1, 2, 2, 2048, 2048, 16, 16)
    scores = score_matrix_bytes(2048, 2048, heads=2)  # 32 MiB
    tiled = peak_allocated_bytes(lambda: tiled_attention(q, k, v, block_size=256))
    naive = peak_allocated_bytes(lambda: causal_attention(q, k, v))
    assert naive >= 2 * scores  # it holds the scores and their exponentials at once
    assert tiled < scores / 8
    half = peak_allocated_bytes(lambda: tiled_attention(*(x[:, :, :1024] for x in (q, k, v))))
    assert tiled < 2.5 * half  # doubling T roughly doubles it (4x would be quadratic)


def test_low_precision_result_has_input_dtype():
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _qkv(1, 2, 1, 9, 9, 8, 8, dtype)
        got = tiled_attention(q, k, v, block_size=4)
        assert got.dtype == dtype
        expected = brute_force(q, k, v, torch.arange(9)[None], torch.arange(9)[None]).to(dtype)
        torch.testing.assert_close(got, expected, rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


def test_errors_are_value_errors():
    q, k, v = _qkv(1, 3, 2, 4, 4, 8, 8)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        tiled_attention(q, k, v)
    q, k, v = _qkv(1, 2, 1, 4, 4, 8, 8)
    with pytest.raises(ValueError, match="block_size"):
        tiled_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="allowed"):
        tiled_attention(q, k, v, allowed=torch.ones(3, 4, dtype=torch.bool))


def test_no_queries_or_no_keys():
    q, k, v = _qkv(1, 2, 1, 0, 5, 4, 3)
    assert tiled_attention(q, k, v).shape == (1, 2, 0, 3)
    q, k, v = _qkv(1, 2, 1, 3, 0, 4, 3)
    got = tiled_attention(q, k, v, query_positions=torch.arange(3))
    assert torch.equal(got, torch.zeros(1, 2, 3, 3))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    ratio=st.integers(1, 3),
    queries=st.integers(1, 12),
    extra_keys=st.integers(0, 10),
    dim=st.integers(1, 8),
    value_dim=st.integers(1, 8),
    block_size=st.integers(1, 16),
    window=st.one_of(st.none(), st.integers(1, 8)),
    padded=st.booleans(),
    per_head=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_equals_causal_attention(
    batch, kv_heads, ratio, queries, extra_keys, dim, value_dim, block_size, window, padded,
    per_head, dtype, seed,
):  # fmt: skip
    keys = queries + extra_keys
    q, k, v = _qkv(batch, kv_heads * ratio, kv_heads, queries, keys, dim, value_dim, dtype, seed)
    lengths = torch.randint(0, keys + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    key_pos, allowed = left_padding(lengths, keys) if padded else (torch.arange(keys), None)
    query_pos = key_pos[..., keys - queries :]
    if window is not None:
        in_window = sliding_window(query_pos, key_pos, window)
        allowed = in_window if allowed is None else allowed & in_window
    if per_head:  # a different random mask for every sequence, head, query and key
        gen = torch.Generator().manual_seed(seed + 1)
        random = torch.rand(batch, kv_heads * ratio, queries, keys, generator=gen) < 0.7
        allowed = random if allowed is None else allowed & random
    expected = causal_attention(q, k, v, query_pos, key_pos, allowed)
    got = tiled_attention(q, k, v, query_pos, key_pos, allowed, block_size=block_size)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32:
        assert torch.allclose(got, expected, atol=1e-5)
    else:  # both compute in float32; rounding to 8 or 11 bits may land one step apart
        torch.testing.assert_close(got, expected, rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


# The backward pass (eqs. 16.1-16.5): gradients through the tiles.


def _grads(attention, q, k, v, grad_out, dtype):
    """dQ, dK, dV of attention(q, k, v), inputs cast to dtype, for the upstream grad_out."""
    inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(attention(*inputs), inputs, grad_out.to(dtype))


def _padded_window_case(seed, dtype=torch.float64):
    """GQA (4 query heads on 2 KV heads), T = 5 < S = 8, a window of 3 and left padding."""
    q, k, v = _qkv(3, 4, 2, 5, 8, 3, 2, dtype, seed)
    key_pos, allowed = left_padding([8, 3, 0], 8)  # row 2 is all pads: it sees no key
    query_pos = key_pos[:, 3:]
    return q, k, v, query_pos, key_pos, allowed & sliding_window(query_pos, key_pos, 3)


@pytest.mark.parametrize("block_size", [1, 2, 3, 8])
def test_gradcheck_float64_gqa_window_padding(block_size):
    q, k, v, query_pos, key_pos, allowed = _padded_window_case(seed=block_size)
    inputs = tuple(x.requires_grad_() for x in (q, k, v))
    scale = 0.7 if block_size == 3 else None

    def attention(q, k, v):
        return tiled_attention(q, k, v, query_pos, key_pos, allowed, scale, block_size)

    assert torch.autograd.gradcheck(attention, inputs)


def test_gradcheck_float64_default_positions_and_a_per_head_mask():
    q, k, v = _qkv(2, 6, 3, 7, 7, 4, 5, torch.float64, seed=3)
    allowed = torch.rand(2, 6, 7, 7, generator=torch.Generator().manual_seed(3)) < 0.6
    inputs = tuple(x.requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: tiled_attention(q, k, v, allowed=allowed, block_size=3), inputs
    )


def _random_case(batch, kv_heads, ratio, queries, extra_keys, dim, window, padded, seed):
    """q, k, v, grad_out in float64, positions, and the `allowed` mask of one hypothesis draw."""
    keys = queries + extra_keys
    q, k, v = _qkv(batch, kv_heads * ratio, kv_heads, queries, keys, dim, dim, torch.float64, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, keys + 1, (batch,), generator=gen)
    key_pos, allowed = left_padding(lengths, keys) if padded else (torch.arange(keys), None)
    query_pos = key_pos[..., keys - queries :].expand(batch, queries)
    key_pos = key_pos.expand(batch, keys)
    if window is not None:
        in_window = sliding_window(query_pos, key_pos, window)
        allowed = in_window if allowed is None else allowed & in_window
    return q, k, v, grad_out, query_pos, key_pos, allowed


CONFIGURATIONS = {
    "batch": st.integers(1, 3),
    "kv_heads": st.integers(1, 3),
    "ratio": st.integers(1, 3),
    "queries": st.integers(1, 12),
    "extra_keys": st.integers(0, 10),
    "dim": st.integers(1, 8),
    "window": st.one_of(st.none(), st.integers(1, 8)),
    "padded": st.booleans(),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=200, deadline=None)
@given(block_size=st.integers(1, 16), **CONFIGURATIONS)
def test_float32_gradients_equal_sdpa_float64(block_size, **config):
    q, k, v, grad_out, query_pos, key_pos, allowed = _random_case(**config)
    mask = bottom_right_mask(query_pos, key_pos, allowed)
    expected = _grads(lambda q, k, v: sdpa(q, k, v, mask), q, k, v, grad_out, torch.float64)

    def tiled(q, k, v):
        return tiled_attention(q, k, v, query_pos, key_pos, allowed, block_size=block_size)

    got = _grads(tiled, q, k, v, grad_out, torch.float32)
    for name, g, e in zip(("dQ", "dK", "dV"), got, expected):
        assert g.dtype == torch.float32 and g.shape == e.shape, name
        error = float((g.double() - e).abs().max())
        assert error <= 1e-5 * (1 + float(e.abs().max())), (name, error)


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(1, 16),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    **CONFIGURATIONS,
)
def test_low_precision_gradients_within_twice_sdpa_error(block_size, dtype, **config):
    # FlashAttention's rule: the error against a float64 reference is at most a small multiple
    # of the error that the reference implementation makes in the same low precision.
    q, k, v, grad_out, query_pos, key_pos, allowed = _random_case(**config)
    mask = bottom_right_mask(query_pos, key_pos, allowed)
    fused = lambda q, k, v: sdpa(q, k, v, mask)  # noqa: E731
    expected = _grads(fused, q, k, v, grad_out, torch.float64)
    low = _grads(fused, q, k, v, grad_out, dtype)

    def tiled(q, k, v):
        return tiled_attention(q, k, v, query_pos, key_pos, allowed, block_size=block_size)

    got = _grads(tiled, q, k, v, grad_out, dtype)
    for name, g, lo, e in zip(("dQ", "dK", "dV"), got, low, expected):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        floor = torch.finfo(dtype).eps * (1 + float(e.abs().max()))  # one rounding step
        error, reference_error = (float((x.double() - e).abs().max()) for x in (g, lo))
        assert error <= 2 * reference_error + floor, (name, error, reference_error)


def test_saves_nothing_of_size_t_by_s():
    q, k, v = _qkv(1, 4, 2, 64, 96, 8, 8)  # T x S = 6144 > every tensor of T or S rows
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    inputs = [x.requires_grad_() for x in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = tiled_attention(*inputs, block_size=16)
    assert shapes, "the Function saved nothing for its backward"
    assert all(math.prod(shape) < 64 * 96 for shape in shapes), shapes
    assert (1, 4, 64) in shapes  # L, one log-sum-exp per query row [B, Hq, T]
    assert len(shapes) == 5  # q, k, v, O and L
    out.sum().backward()  # an expanded (stride 0) upstream gradient works too
    assert all(torch.isfinite(x.grad).all() for x in inputs)


def test_no_grad_calls_build_no_graph():
    q, k, v = _qkv(1, 2, 1, 8, 8, 4, 4)
    assert tiled_attention(q, k, v).grad_fn is None  # no input requires grad
    inputs = [x.requires_grad_() for x in (q, k, v)]
    saved = []
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):
        assert tiled_attention(*inputs).grad_fn is None
    assert saved == []
    assert tiled_attention(*inputs).grad_fn is not None


def test_rows_that_see_no_key_get_zero_gradients():
    q, k, v = _qkv(3, 2, 1, 6, 6, 4, 4)
    positions, allowed = left_padding([6, 2, 0], 6)  # row 1 has 4 pads, row 2 is all pads
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))

    def tiled(q, k, v):
        return tiled_attention(q, k, v, positions, positions, allowed, block_size=4)

    dq, dk, dv = _grads(tiled, q, k, v, grad_out, torch.float32)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    for g in (dq, dk, dv):  # pad queries read nothing; pad keys are read by no one
        assert torch.equal(g[1, :, :4], torch.zeros_like(g[1, :, :4]))
        assert torch.equal(g[2], torch.zeros_like(g[2]))
    naive = _grads(
        lambda q, k, v: causal_attention(q, k, v, positions, positions, allowed),
        q, k, v, grad_out, torch.float32,
    )  # fmt: skip
    for g, e in zip((dq, dk, dv), naive):
        assert torch.allclose(g, e, atol=1e-5)


def test_backward_never_reads_hidden_key_blocks():
    q, k, v = _qkv(1, 2, 2, 8, 8, 4, 4)
    k[:, :, 4:], v[:, :, 4:] = float("nan"), float("nan")  # keys 4..7: hidden from queries 0..3
    dq = _grads(
        lambda q, k, v: tiled_attention(q, k, v, block_size=4)[:, :, :4],
        q, k, v, torch.ones(1, 2, 4, 4), torch.float32,
    )[0]  # fmt: skip
    assert torch.isfinite(dq[:, :, :4]).all()  # queries 0..3 skipped the NaN block
    clean = [x[:, :, :4] for x in (q, k, v)]
    expected = _grads(causal_attention, *clean, torch.ones(1, 2, 4, 4), torch.float32)[0]
    assert torch.allclose(dq[:, :, :4], expected, atol=1e-6)


def test_forward_and_backward_memory_is_linear():
    q, k, v = (x.requires_grad_() for x in _qkv(1, 1, 1, 2048, 2048, 16, 16))
    scores = score_matrix_bytes(2048, 2048)  # 16 MiB

    def train_step(attention):
        def step():
            torch.autograd.grad(attention(q, k, v).sum(), (q, k, v))

        return step

    tiled = peak_allocated_bytes(train_step(lambda q, k, v: tiled_attention(q, k, v)))
    naive = peak_allocated_bytes(train_step(causal_attention))
    assert naive >= 2 * scores  # autograd keeps the [T, S] weights for the backward
    assert tiled < scores / 8
