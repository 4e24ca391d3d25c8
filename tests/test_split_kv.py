"""Split-KV decoding equals `causal_attention`, over random cache lengths and chunk sizes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib import causal_attention
from attnlib.lab.split_kv import chunk_bounds, merge_all, split_kv_attention


@settings(max_examples=60, deadline=None)
@given(
    keys=st.integers(1, 300),
    queries=st.integers(1, 3),
    chunk=st.integers(1, 320),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    workers=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_split_kv_equals_causal_attention(keys, queries, chunk, kv_heads, group, workers, seed):
    queries = min(queries, keys)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, kv_heads * group, queries, 8, generator=gen)
    k = torch.randn(2, kv_heads, keys, 8, generator=gen)
    v = torch.randn(2, kv_heads, keys, 5, generator=gen)
    out = split_kv_attention(q, k, v, chunk, workers=workers)
    assert torch.allclose(out, causal_attention(q, k, v), atol=2e-6, rtol=0)


def test_positions_pass_through_and_chunks_in_a_query_future_are_empty():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 4, generator=gen) for n in (1, 40, 40))
    query_positions = torch.tensor([9])  # sees keys 0..9 only: chunks 2.. see nothing
    out = split_kv_attention(q, k, v, 8, query_positions=query_positions, workers=2)
    want = causal_attention(q, k, v, query_positions=query_positions)
    assert torch.allclose(out, want, atol=2e-6, rtol=0)
    assert not torch.isnan(out).any()


def test_chunk_bounds_cover_the_keys_once_and_bad_chunks_are_refused():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(3, 8) == [(0, 3)]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk"):
            chunk_bounds(10, bad)
    with pytest.raises(ValueError, match="no partials"):
        merge_all([])


def test_the_timing_helpers_time_every_configuration():
    from attnlib.lab.split_kv import decode_timings, thread_control

    times = decode_timings(keys=256, dim=8, chunks=(256, 64), workers=(1, 2), repeats=1)
    assert set(times) == {(256, 1), (256, 2), (64, 1), (64, 2)}
    assert all(seconds > 0 for seconds in times.values())
    assert set(thread_control(size=32, repeats=1)) == {"one thread", "two threads"}


def test_the_reading_of_the_timings_follows_the_control():
    from attnlib.lab.split_kv import read_control as wrapped

    def read_control(timings, control):  # the reading with its line breaks undone
        text = wrapped(timings, control)
        assert all(len(line) <= 80 for line in text.splitlines())
        return " ".join(text.split())

    timings = {
        64: {(64, 1): 1.0, (64, 2): 1.1, (16, 1): 2.0, (16, 2): 0.5},
        256: {(256, 1): 4.0, (256, 2): 4.0, (128, 1): 4.2, (128, 2): 3.0},
    }
    busy = read_control(timings, {"one thread": 3.77e-3, "two threads": 4.17e-3})
    assert "no second core was free" in busy and "noise" in busy and "keys" not in busy
    for nan in ({"one thread": float("nan"), "two threads": 1.0}, {"one thread": 1.0,
                "two threads": float("nan")}):  # fmt: skip
        assert "no second core was free" in read_control(timings, nan)
    free = read_control(timings, {"one thread": 4.0, "two threads": 2.0})
    assert "a second core was free" in free
    assert "64 keys: the best split (chunks of 16, two workers) took 0.50" in free
    assert "256 keys: the best split (chunks of 128, two workers) took 0.75" in free
