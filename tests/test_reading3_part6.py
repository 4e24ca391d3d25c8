"""Part VI after the third reading: the tiles a process computes are counted where they are
computed, and striped shards are neither skip-free nor balanced in pairs.

`TileCounter` counts the matrix products torch runs; it is checked here against a count of
every (query, key) pair written out below, with no code shared with `attnlib.lab.ring`.
"""

import torch

from attnlib import tiled_attention
from attnlib.lab.ring import (
    TileCounter,
    pairs_visible,
    schedule,
    shard_positions,
    tiles_computed,
)


def tiles_by_hand(query_positions, key_positions, tile):
    """Tiles of the (query, key) grid, cut every `tile` in the given order, holding a pair
    with key position <= query position."""
    queries, keys = query_positions.tolist(), key_positions.tolist()
    count = 0
    for i in range(0, len(queries), tile):
        for j in range(0, len(keys), tile):
            if any(k <= q for q in queries[i : i + tile] for k in keys[j : j + tile]):
                count += 1
    return count


def test_the_counter_counts_the_tiles_tiled_attention_computes():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        queries, keys = (int(n) for n in torch.randint(1, 30, (2,), generator=gen))
        tile = int(torch.randint(1, 9, (1,), generator=gen))
        query_positions = torch.randperm(60, generator=gen)[:queries]
        key_positions = torch.randperm(60, generator=gen)[:keys]
        q = torch.randn(1, 2, queries, 4, generator=gen)
        k, v = (torch.randn(1, 1, keys, 4, generator=gen) for _ in range(2))
        with TileCounter() as counter:
            tiled_attention(q, k, v, query_positions, key_positions, block_size=tile)
        want = tiles_by_hand(query_positions, key_positions, tile)
        assert counter.products == 2 * want, trial
        assert counter.tiles == want == tiles_computed(query_positions, key_positions, tile)


def test_a_shard_wholly_in_the_future_runs_no_product():
    q, k, v = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    with TileCounter() as counter:
        out, lse = tiled_attention(
            q, k, v, torch.arange(8), torch.arange(8, 16), block_size=4, return_lse=True
        )
    assert counter.products == 0 and (out == 0).all() and torch.isinf(lse).all()


def test_striped_shards_skip_tiles_and_split_the_pairs_unevenly():
    world, length, tile = 4, 64, 4
    held = [shard_positions("striped", r, world, length) for r in range(world)]
    pairs = [pairs_visible(held[r], range(length)) for r in range(world)]
    assert pairs == [496, 512, 528, 544]  # not balanced exactly
    zigzag = [pairs_visible(shard_positions("zigzag", r, world, length), range(length))
              for r in range(world)]  # fmt: skip
    assert zigzag == [520] * world  # zigzag is
    q = torch.randn(1, 1, length // world, 4)
    for rank in range(world):
        for source in range(world):
            with TileCounter() as counter:
                tiled_attention(q, q, q, held[rank], held[source], block_size=tile)
            assert counter.tiles == 10 == tiles_by_hand(held[rank], held[source], tile)
            assert 16 - counter.tiles == 6  # wholly hidden tiles, skipped
    steps = schedule(world, length, "striped", tile)
    assert all(tiles == 10 for step in steps for _, tiles in step)
