"""flex_causal_attention: the positions rule as a FlexAttention mask_mod, against causal_attention.

Every compile of a new shape costs seconds on the CPU, so the checks share three shapes: a chunk
of 8 queries (4 heads on 2 KV heads) over 48 keys and one decode query, both as in chapter 15
(whose compiles Inductor's disk cache then shares), and the chunk with 4 KV heads (plain MHA).
Positions, pads and windows change only tensors the mask_mod reads, which needs no recompile.
"""

import shutil

import pytest
import torch

from attnlib import causal_attention, left_padding, sliding_window
from attnlib.lab import flex

BATCH, Q_HEADS, KV_HEADS, QUERIES, KEYS, DIM = 2, 4, 2, 8, 48, 16
compiles = pytest.mark.skipif(not shutil.which("g++"), reason="FlexAttention compiles with g++")


def qkv(seed, queries=QUERIES, q_heads=Q_HEADS, kv_heads=KV_HEADS):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, q_heads, queries, DIM, generator=gen)
    k, v = (torch.randn(BATCH, kv_heads, KEYS, DIM, generator=gen) for _ in range(2))
    return q, k, v


def reference(q, k, v, query_positions, key_positions, window=None):
    """causal_attention with left_padding's pad rule (keys at negative positions hidden)."""
    allowed = (key_positions >= 0)[:, None, None, :]  # [B, 1, 1, S]
    if window is not None:
        allowed = allowed & sliding_window(query_positions, key_positions, window)
    return causal_attention(q, k, v, query_positions, key_positions, allowed)


@compiles
def test_defaults_are_causal_attentions():  # chunked prefill: queries 40..47 over keys 0..47
    q, k, v = qkv(0)
    got = flex.flex_causal_attention(q, k, v)
    assert (got - causal_attention(q, k, v)).abs().max() < 1e-5
    scale = 0.3
    got = flex.flex_causal_attention(q, k, v, scale=scale)
    assert (got - causal_attention(q, k, v, scale=scale)).abs().max() < 1e-5


@compiles
def test_random_positions_pads_and_windows():
    gen = torch.Generator().manual_seed(1)
    for seed in range(6):
        q, k, v = qkv(10 + seed)
        lengths = torch.randint(1, KEYS + 1, (BATCH,), generator=gen)
        key_pos, _ = left_padding(lengths, KEYS)  # [B, S], pads negative
        gaps = torch.randint(0, 3, (BATCH, KEYS), generator=gen).cumsum(1)  # positions with holes
        key_pos = torch.where(key_pos >= 0, key_pos + gaps, key_pos)
        query_pos = key_pos[:, -QUERIES:]  # the newest 8 slots: some may be pads
        window = [None, 1, 5, 17][seed % 4]
        got = flex.flex_causal_attention(q, k, v, query_pos, key_pos, window=window)
        expected = reference(q, k, v, query_pos, key_pos, window)
        assert (got - expected).abs().max() < 1e-5, (seed, lengths.tolist(), window)


@compiles
def test_pad_queries_output_zeros_and_real_rows_match_alone():
    q, k, v = qkv(2)
    positions, _ = left_padding([KEYS, 4], KEYS)  # row 1: 44 pads, then 4 tokens
    got = flex.flex_causal_attention(q, k, v, positions[:, -QUERIES:], positions)
    assert torch.equal(got[1, :, :4], torch.zeros(Q_HEADS, 4, DIM))  # 4 pad queries
    alone = causal_attention(q[1:, :, 4:], k[1:, :, -4:], v[1:, :, -4:])  # the 4 real tokens
    assert (got[1:, :, 4:] - alone).abs().max() < 1e-5


@compiles
def test_decode_query_sees_the_whole_cache():
    q, k, v = qkv(3, queries=1)  # position 47 against keys 0..47
    got = flex.flex_causal_attention(q, k, v)
    assert (got - causal_attention(q, k, v)).abs().max() < 1e-5
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    assert (got - top_left).abs().max() > 0.1  # key 0 only: not the same attention
    windowed = flex.flex_causal_attention(q, k, v, window=6)
    expected = causal_attention(q, k[:, :, -6:], v[:, :, -6:])  # the last 6 keys
    assert (windowed - expected).abs().max() < 1e-5


@compiles
def test_plain_multi_head_attention():  # Hkv = Hq: no enable_gqa
    q, k, v = qkv(7, kv_heads=Q_HEADS)
    positions, _ = left_padding([40, 9], KEYS)
    got = flex.flex_causal_attention(q, k, v, positions[:, -QUERIES:], positions, window=12)
    expected = reference(q, k, v, positions[:, -QUERIES:], positions, window=12)
    assert (got - expected).abs().max() < 1e-5


def computed_tiles(block_mask) -> int:
    return int((block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).sum())


def test_block_mask_skips_the_tiles_the_rule_hides():
    positions = torch.arange(1024)[None]  # [1, 1024]: 8 blocks of 128
    causal = flex.positions_block_mask(positions, positions)
    window = flex.positions_block_mask(positions, positions, window=256)
    assert computed_tiles(causal) == 8 * 9 // 2  # the triangle of tiles
    assert computed_tiles(window) == 8 + 7 + 6  # the diagonal and two blocks back
    assert int(causal.full_kv_num_blocks.sum()) == 8 * 7 // 2  # below the diagonal: no mask


def test_bad_inputs():
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="window"):
        flex.flex_causal_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="window"):
        flex.flex_causal_attention(q, k, v, window=2.5)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        flex.flex_causal_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="more queries"):
        flex.flex_causal_attention(torch.randn(BATCH, Q_HEADS, KEYS + 1, DIM), k, v)
    with pytest.raises(ValueError, match="float32"):
        flex.flex_causal_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="no backward on the CPU"):
        flex.flex_causal_attention(q.requires_grad_(), k, v)


def test_no_compiler_says_what_to_install(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-attnlib")
    q, k, v = qkv(5)
    with pytest.raises(RuntimeError, match="install one"):
        flex.flex_causal_attention(q, k, v)


def test_empty_inputs_give_empty_outputs_without_compiling():
    q, k, v = qkv(6)
    got = flex.flex_causal_attention(q[:, :, :0], k, v)
    assert got.shape == (BATCH, Q_HEADS, 0, DIM)
