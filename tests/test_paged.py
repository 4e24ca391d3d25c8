"""The paged KV cache equals the contiguous `KVCache`; prefix sharing, copy on write, bad input."""

import random

import pytest
import torch

from attnlib import KVCache, causal_attention
from attnlib.lab.paged import PagedKVCache, gather, memory_table, paged_attention

HEADS, KV_HEADS, DIM = 4, 2, 8


def token(gen):
    return torch.randn(KV_HEADS, DIM, generator=gen), torch.randn(KV_HEADS, DIM, generator=gen)


@pytest.mark.parametrize("seed", range(6))
def test_paged_equals_contiguous_for_every_sequence_and_step(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block_size = rng.choice([1, 3, 4, 16])
    targets = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
    paged = PagedKVCache(64, block_size, KV_HEADS, DIM)
    contiguous = {s: KVCache() for s in range(len(targets))}
    for s in contiguous:
        paged.add(s)
    while any(paged.lengths[s] < n for s, n in enumerate(targets)):
        live = [s for s, n in enumerate(targets) if paged.lengths[s] < n]
        s = rng.choice(live)  # sequences grow in an interleaved order
        key, value = token(gen)
        position = paged.lengths[s]
        paged.append(s, key, value)
        keys, values, positions = contiguous[s].append(
            key[None, :, None], value[None, :, None], torch.tensor([position])
        )
        q = torch.randn(1, HEADS, 1, DIM, generator=gen)
        got = paged.attend([s], q, torch.tensor([[position]]))
        want = causal_attention(
            q, keys, values, query_positions=torch.tensor([position]), key_positions=positions
        )
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
        if paged.lengths[s] == targets[s] and rng.random() < 0.5:
            paged.finish(s)  # a finished sequence gives its blocks back
            targets[s] = 0
            paged.lengths[s] = 0
            paged.tables[s] = []
    assert paged.blocks_in_use() <= 64


def test_a_batch_of_sequences_with_several_queries_each():
    gen = torch.Generator().manual_seed(3)
    paged = PagedKVCache(32, 4, KV_HEADS, DIM)
    lengths = [5, 13, 9]
    caches = []
    for s, n in enumerate(lengths):
        paged.add(s)
        keys = torch.randn(KV_HEADS, n, DIM, generator=gen)
        values = torch.randn(KV_HEADS, n, DIM, generator=gen)
        paged.append(s, keys, values)
        caches.append((keys, values))
    q = torch.randn(3, HEADS, 2, DIM, generator=gen)
    query_positions = torch.tensor([[3, 4], [11, 12], [0, 8]])
    got = paged.attend([0, 1, 2], q, query_positions)
    for b, (keys, values) in enumerate(caches):
        want = causal_attention(
            q[b : b + 1], keys[None], values[None], query_positions=query_positions[b]
        )
        assert torch.allclose(got[b : b + 1], want, atol=1e-6, rtol=0)


def test_prefix_sharing_counts_shared_blocks_once_and_copies_on_write():
    gen = torch.Generator().manual_seed(4)
    paged = PagedKVCache(16, 4, KV_HEADS, DIM)
    paged.add("a")
    prompt = torch.randn(KV_HEADS, 10, DIM, generator=gen)
    paged.append("a", prompt, prompt * 2)
    assert paged.blocks_in_use() == 3  # 4 + 4 + 2 tokens
    paged.fork("a", "b")
    assert paged.blocks_in_use() == 3 and paged.tables["a"] == paged.tables["b"]
    shared_last = paged.tables["a"][-1]
    key_a, value_a = token(gen)
    paged.append("a", key_a, value_a)  # writes into the shared, half-full block: copy
    assert paged.tables["a"][-1] != shared_last and paged.tables["b"][-1] == shared_last
    assert paged.tables["a"][:2] == paged.tables["b"][:2]
    assert paged.blocks_in_use() == 4
    key_b, value_b = token(gen)
    paged.append("b", key_b, value_b)  # b now holds its block alone: no copy
    assert paged.tables["b"][-1] == shared_last and paged.blocks_in_use() == 4
    for seq, key in (("a", key_a), ("b", key_b)):
        keys = gather(paged.keys, paged.tables[seq], paged.lengths[seq])
        assert torch.equal(keys[:, :10], prompt) and torch.equal(keys[:, 10], key)
    paged.finish("a")
    assert paged.blocks_in_use() == 3  # b still holds the shared prompt blocks
    paged.finish("b")
    assert paged.blocks_in_use() == 0 and len(paged.free) == 16


def test_bad_input_gets_a_clear_error():
    pool = torch.zeros(4, KV_HEADS, 2, DIM)
    with pytest.raises(ValueError, match="block 7, past the pool of 4 blocks"):
        gather(pool, [0, 7], 4)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        gather(pool, [0], 3)
    q = torch.zeros(1, HEADS, 1, DIM)
    with pytest.raises(ValueError, match="position 5 is beyond sequence 0's length 3"):
        paged_attention(q, pool, pool, [[0, 1]], [3], torch.tensor([[5]]))
    paged = PagedKVCache(2, 2, KV_HEADS, DIM)
    paged.add(0)
    paged.append(0, torch.zeros(KV_HEADS, 4, DIM), torch.zeros(KV_HEADS, 4, DIM))
    with pytest.raises(ValueError, match="pool full: all 2 blocks in use"):
        paged.append(0, torch.zeros(KV_HEADS, DIM), torch.zeros(KV_HEADS, DIM))
    with pytest.raises(ValueError, match="exists already"):
        paged.add(0)


def test_memory_table_counts_blocks_and_reserved_slots():
    table = memory_table([1, 16, 17], block_size=16, kv_heads=1, head_dim=1, bytes_per_number=4)
    assert table["tokens"] == 34 and table["blocks"] == 4
    assert table["paged_bytes"] == 4 * 16 * 8 and table["contiguous_bytes"] == 3 * 17 * 8
    assert table["paged_used"] == 34 / 64
    limit = memory_table([1, 16, 17], 16, 1, 1, bytes_per_number=4, reserve=32)
    assert limit["contiguous_bytes"] == 3 * 32 * 8 and limit["paged_bytes"] == 4 * 16 * 8
    assert limit["contiguous_used"] == 34 / 96
    with pytest.raises(ValueError, match="below the longest length"):
        memory_table([1, 16, 17], 16, 1, 1, reserve=16)


def test_the_block_table_figure_draws_every_block():
    from attnlib.figures.paged import block_table_figure
    from attnlib.figures.plots import plt

    paged = PagedKVCache(20, 4, KV_HEADS, DIM)
    paged.add("a")
    paged.append("a", torch.zeros(KV_HEADS, 6, DIM), torch.zeros(KV_HEADS, 6, DIM))
    paged.fork("a", "b")
    fig = block_table_figure(paged, per_row=8)
    assert len(fig.axes[0].patches) == 20
    plt.close(fig)
