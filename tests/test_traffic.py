"""attnlib.lab.traffic: Dao et al.'s slow-memory traffic, counted; attnlib.lab.page_faults."""

import math
import mmap

import pytest

from attnlib.lab import page_faults, traffic


def test_naive_traffic_is_4nd_plus_4n2():
    assert traffic.naive_traffic(4096, 64) == 4 * 4096 * 64 + 4 * 4096**2
    assert traffic.naive_traffic(2048, 64) * 4 > traffic.naive_traffic(4096, 64) * 0.99


def test_tile_sizes_follow_algorithm_1():
    assert traffic.tile_sizes(64, 12_288) == (48, 48)  # M / 4d = 48 < d
    assert traffic.tile_sizes(64, 524_288) == (64, 2048)  # B_r capped at d
    with pytest.raises(ValueError):
        traffic.tile_sizes(64, 100)


def test_tiled_traffic_falls_like_one_over_m():
    n, d = 8192, 64
    small, large = (traffic.tiled_traffic(n, d, m) for m in (2**16, 2**18))
    quadratic = lambda m: traffic.tiled_traffic(n, d, m) - 2 * n * d  # noqa: E731
    assert 3.9 < quadratic(2**16) / quadratic(2**18) < 4.1  # four times M, a quarter
    assert small > large > 4 * n * d
    # fits everything: K, V once, Q, O once each way
    assert traffic.tiled_traffic(n, d, 4 * d * n) == 5 * n * d + 4 * n


def test_tiled_beats_naive_once_tiles_are_wide():
    n, d = 4096, 64
    assert traffic.tiled_traffic(n, d, 64 * d * d) < traffic.naive_traffic(n, d) / 8
    assert math.isclose(
        traffic.tiled_traffic(n, d, 4 * d * 48) / traffic.naive_traffic(n, d), 1, rel_tol=0.05
    )  # tiles narrower than d: no gain


def test_cache_sizes_reads_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate(
        [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K")]
    ):
        folder = tmp_path / f"index{i}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    assert traffic.cache_sizes(str(tmp_path)) == [(1, "Data", 48 * 1024), (2, "Unified", 2 * 2**20)]
    assert traffic.cache_sizes(str(tmp_path / "absent")) == []


def test_page_faults_counts_the_first_touch_of_fresh_memory():
    """A fresh anonymous mapping faults when first touched, and not when touched again. (Whether
    a fresh *tensor* faults depends on the C library's allocator, which may reuse memory.)"""
    size = 16 * 2**20
    region = mmap.mmap(-1, size)

    def touch():
        for offset in range(0, size, page_faults.PAGE_BYTES):
            region[offset] = 1

    first = page_faults.minor_faults(touch)
    assert first >= size // (2 * 2**20)  # a fault a page, or at least one per 2 MiB huge page
    assert page_faults.minor_faults(touch) < first  # the pages are mapped now
    with pytest.raises(ValueError):
        page_faults.fresh_page_seconds(16)
