"""Property-based tests: attnlib against float64 brute force and PyTorch's SDPA."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlib
from attnlib import causal_attention, left_padding, sliding_window

from .references import bottom_right_mask, brute_force, sdpa

TOLERANCE = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}


@st.composite
def attention_case(draw):
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    q_heads = kv_heads * draw(st.integers(1, 3))
    queries = draw(st.integers(1, 6))
    keys = queries + draw(st.integers(0, 5))
    dim, value_dim = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, queries, dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, keys, value_dim, generator=generator).to(dtype)
    # Padded rows: each row is left-padded to `keys`, with its own positions.
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(0, keys), min_size=batch, max_size=batch))
        key_positions, allowed = left_padding(lengths, keys)  # [B, S], [B, 1, 1, S]
    else:
        key_positions, allowed = torch.arange(keys).expand(batch, keys), None
    query_positions = key_positions[:, keys - queries :]  # the last T keys of each row
    window = draw(st.one_of(st.none(), st.integers(1, 6)))
    if window is not None:
        in_window = sliding_window(query_positions, key_positions, window)  # [B, 1, T, S]
        allowed = in_window if allowed is None else allowed & in_window
    scale = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    return q, k, v, query_positions, key_positions, allowed, scale


@settings(max_examples=150, deadline=None)
@given(case=attention_case())
def test_equals_float64_brute_force_and_sdpa(case):
    q, k, v, query_positions, key_positions, allowed, scale = case
    out = causal_attention(q, k, v, query_positions, key_positions, allowed, scale)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[3])
    expected = brute_force(q, k, v, query_positions, key_positions, allowed, scale)
    tolerance = TOLERANCE[q.dtype]
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance)
    mask = bottom_right_mask(query_positions, key_positions, allowed)
    fused = sdpa(q.float(), k.float(), v.float(), mask, scale)
    assert torch.allclose(out.float(), fused, atol=max(tolerance, 1e-5), rtol=tolerance)
    # The fused switch: the same call through PyTorch's kernel, in float32 like the reference.
    switched = causal_attention(
        q.float(), k.float(), v.float(), query_positions, key_positions, allowed, scale, fused=True
    )
    assert torch.allclose(switched, out.float(), atol=max(tolerance, 1e-5), rtol=tolerance)


@settings(max_examples=30, deadline=None)
@given(case=attention_case())
def test_loops_equal_tensor_version(case):
    q, k, v, _, _, _, scale = case
    q, k, v = q[:1].float(), k[:1].float(), v[:1].float()  # one sequence, plain positions
    out = causal_attention(q, k, v, scale=scale)[0]  # [Hq, T, Dv]
    as_rows = lambda x: attnlib.merge_heads(x)[0].tolist()  # noqa: E731  [T][H*D]
    looped = attnlib.loops.causal_attention(
        as_rows(q), as_rows(k), as_rows(v), q.shape[1], k.shape[1], scale=scale
    )
    expected = attnlib.merge_heads(out[None])[0]
    assert torch.allclose(torch.tensor(looped), expected, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    q_heads_kv=st.sampled_from([(4, 4), (4, 2), (6, 3), (4, 1)]),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    d_in=st.integers(2, 6),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_cached_and_chunked_equal_full_forward(q_heads_kv, chunks, d_in, bias, seed):
    torch.manual_seed(seed)
    q_heads, kv_heads = q_heads_kv
    layer = attnlib.MultiHeadAttention(d_in, 2 * q_heads, q_heads, kv_heads, bias=bias)
    x = torch.randn(2, sum(chunks), d_in)
    full = layer(x)
    cache, pieces, start = attnlib.KVCache(), [], 0
    for size in chunks:
        pieces.append(layer(x[:, start : start + size], cache=cache))
        start += size
    assert len(cache) == sum(chunks)
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-6)
