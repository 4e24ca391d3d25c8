"""Ring attention over gloo equals `causal_attention`, with 2 and 4 processes; no hang, no leftover.

Each ring runs every case in one process group (start-up costs seconds); each run has its own
timeout, and a failing or slow run stops all its processes. The tiles the processes count (a
counter of the matrix products torch runs) are checked against `schedule`, which enumerates
the visible pairs one by one.
"""

import multiprocessing

import pytest
import torch

from attnlib import causal_attention
from attnlib.lab.ring import (
    bytes_sent_formula,
    ring_attention,
    ring_runs,
    schedule,
    shard_positions,
    shard_runs,
)

LENGTH, DIM, TILE = 48, 8, 4


def cases():
    gen = torch.Generator().manual_seed(0)
    jobs = []
    for order in ("contiguous", "zigzag", "striped"):
        for causal in (True, False):
            for q_heads, kv_heads in ((2, 2), (4, 1)):  # plain and grouped-query
                q = torch.randn(2, q_heads, LENGTH, DIM, generator=gen)
                k = torch.randn(2, kv_heads, LENGTH, DIM, generator=gen)
                v = torch.randn(2, kv_heads, LENGTH, DIM + 2, generator=gen)
                jobs.append(dict(q=q, k=k, v=v, order=order, causal=causal, tile=TILE))
    return jobs


def no_children_left():
    return not multiprocessing.active_children()


@pytest.mark.parametrize("world, start_method", [(2, "spawn"), (4, "forkserver")])
def test_ring_equals_causal_attention(world, start_method):
    jobs = cases()
    results = ring_runs(jobs, world, timeout=90, start_method=start_method)
    assert no_children_left()
    for job, result in zip(jobs, results):
        want = causal_attention(job["q"], job["k"], job["v"], causal=job["causal"])
        assert torch.allclose(result.out, want, atol=2e-6, rtol=0), (world, job["order"])
        kv_heads = job["k"].shape[1]
        sent = bytes_sent_formula(world, 2, kv_heads, LENGTH, DIM, DIM + 2, 4)
        assert result.bytes_sent == [sent] * world
        steps = schedule(world, LENGTH, job["order"], TILE, job["causal"])
        planned = [[step[r][1] for step in steps] for r in range(world)]
        assert result.tiles_per_step == planned, (world, job["order"], job["causal"])
        assert result.tiles == [sum(counts) for counts in planned]


def test_tiles_before_and_after_balancing():
    def per_process(order, world=4, length=64, tile=4):
        steps = schedule(world, length, order, tile)
        return [sum(step[r][1] for step in steps) for r in range(world)]

    contiguous, zigzag = per_process("contiguous"), per_process("zigzag")
    assert contiguous == sorted(contiguous) and contiguous[-1] > 4 * contiguous[0]
    assert max(zigzag) - min(zigzag) <= 1 and sum(zigzag) == sum(contiguous)
    for step in schedule(4, 64, "zigzag", 4):  # even at every step, not only in total
        assert len({tiles for _, tiles in step}) == 1
    striped = per_process("striped")  # even too, but the diagonal tiles recur at every step
    assert striped == [40] * 4 and sum(striped) > sum(zigzag)
    full = per_process("contiguous", world=2, length=8, tile=4)
    assert full == [1, 2]  # its own diagonal tile, then one full tile of the earlier shard


def test_shards_cover_the_sequence_once():
    for order in ("contiguous", "zigzag", "striped"):
        for world in (1, 2, 4):
            held = torch.cat([shard_positions(order, r, world, 32) for r in range(world)])
            assert sorted(held.tolist()) == list(range(32))
    assert shard_runs("zigzag", 0, 2, 8) == [(0, 2), (6, 8)]
    assert shard_positions("striped", 1, 4, 16).tolist() == [1, 5, 9, 13]
    with pytest.raises(ValueError, match="divisible by 8"):
        shard_runs("zigzag", 0, 4, 20)
    with pytest.raises(ValueError, match="order must be one of"):
        shard_runs("reversed", 0, 2, 8)


def test_a_failing_process_stops_the_ring():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(
        RuntimeError, match="the first: process 1: RuntimeError: process 1 failed on purpose"
    ):
        ring_attention(q, q, q, 2, fail_rank=1, timeout=60)
    assert no_children_left()


def test_a_slow_ring_times_out_and_stops():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(TimeoutError, match="did not finish in 0.5 s"):
        ring_attention(q, q, q, 2, timeout=0.5)
    assert no_children_left()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs"
)
def test_the_nccl_backend_reaches_the_workers():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="a ring process failed"):
        ring_attention(q, q, q, 2, backend="nccl", timeout=60, start_method="forkserver")
    assert no_children_left()


def test_the_ring_figures_count_the_schedule():
    from attnlib.figures.plots import plt
    from attnlib.figures.ring import (
        _pair_owner,
        local_tiles_figure,
        orderings_figure,
        ring_diagram,
        ring_step_figure,
    )

    for order in ("contiguous", "zigzag", "striped"):
        steps = schedule(4, 64, order, 4)
        for step in range(4):
            owner, visible = _pair_owner(4, 64, order, 4, step)
            done = sum(tiles for row in steps[: step + 1] for _, tiles in row)
            assert (owner >= 0).sum() == done * 4 * 4  # the tiles cut the pairs into 4 x 4
        assert (owner >= 0)[visible].all()  # after the last step every visible pair is done
        wasted = ((owner >= 0) & ~visible).sum()  # hidden pairs inside computed tiles
        assert wasted == done * 16 - 64 * 65 // 2 == {"striped": 480}.get(order, 96)
    plt.close(ring_step_figure(4, 64, "zigzag", 4, 1))
    plt.close(ring_diagram(4, 1))
    plt.close(local_tiles_figure(4, 64, 4, 1, 1))
    plt.close(orderings_figure({"zigzag": [[10, 8, 8, 8]] * 4, "striped": [[10] * 4] * 4}))
