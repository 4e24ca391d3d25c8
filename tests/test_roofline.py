"""The roofline helpers of chapter 10: the ceilings' arithmetic, the bandwidth probe, the CPU's
last-level cache and a step timed after evicting it, the plot."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attnlib.figures.roofline import plot_roofline  # noqa: E402
from attnlib.lab.roofline import (  # noqa: E402
    attainable,
    cold_seconds,
    last_level_cache_bytes,
    read_bandwidth,
    ridge,
)


def test_the_roof_is_the_lower_of_the_two_ceilings():
    assert attainable(1.0, 100.0, 10.0) == 10.0  # memory-bound: 1 FLOP/B at 10 GB/s
    assert attainable(50.0, 100.0, 10.0) == 100.0  # compute-bound
    assert ridge(100.0, 10.0) == 10.0
    assert attainable(ridge(100.0, 10.0), 100.0, 10.0) == 100.0


def test_read_bandwidth_is_a_positive_rate_over_the_bytes_read():
    rate = read_bandwidth(torch.ones(1 << 16), torch.ones(1 << 10), repeats=2)
    assert rate > 0


@pytest.mark.parametrize(
    "call",
    [
        lambda: read_bandwidth(),
        lambda: read_bandwidth(torch.ones(0)),
        lambda: attainable(0.0, 1.0, 1.0),
        lambda: ridge(1.0, -1.0),
    ],
    ids=["nothing", "empty", "intensity", "bandwidth"],
)
def test_bad_arguments_are_refused(call):
    with pytest.raises(ValueError):
        call()


def test_the_plot_draws_the_roof_and_every_point():
    fig, ax = plt.subplots()
    plot_roofline(ax, 100.0, 10.0, {"a": (1.0, 5.0), "b": (100.0, 80.0)})
    assert len(ax.get_legend().get_texts()) == 2
    plt.close(fig)


def _fake_cpu(root, caches):
    """A /sys/devices/system/cpu/cpu0 tree with one indexN folder per (level, type, size)."""
    for number, (level, kind, size) in enumerate(caches):
        index = root / "cache" / f"index{number}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return str(root)


def test_last_level_cache_is_the_highest_data_cache_linux_lists(tmp_path):
    cpu = _fake_cpu(
        tmp_path,
        [
            (1, "Data", "48K"),
            (1, "Instruction", "32K"),
            (2, "Unified", "1024K"),
            (3, "Unified", "32768K"),
        ],
    )
    assert last_level_cache_bytes(cpu) == 32 * 2**20
    other = _fake_cpu(tmp_path / "two", [(1, "Data", "32K"), (2, "Unified", "2M")])
    assert last_level_cache_bytes(other) == 2 * 2**20
    assert last_level_cache_bytes(str(tmp_path / "nothing")) is None
    assert last_level_cache_bytes(_fake_cpu(tmp_path / "odd", [(1, "Data", "lots")])) is None


def test_cold_seconds_times_the_call_after_the_eviction():
    reads = []
    big = torch.ones(1 << 16)
    seconds = cold_seconds(lambda: reads.append(1), big, repeats=3)
    assert seconds >= 0 and len(reads) == 4  # a warm-up call, then three timed ones
    with pytest.raises(ValueError, match="evict"):
        cold_seconds(lambda: None)
    with pytest.raises(ValueError, match="repeats"):
        cold_seconds(lambda: None, big, repeats=0)


def test_interleaved_fastest_keeps_each_calls_fastest_run(monkeypatch):
    from attnlib.lab import roofline

    order = []
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    # perf_counter pairs (start, stop) of the timed runs, in order: a, b, a, b, a, b
    durations = iter([3.0, 5.0, 1.0, 7.0, 2.0, 6.0])
    clock = iter(t for d in durations for t in (0.0, d))
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock))
    assert roofline.interleaved_fastest(calls, repeats=3) == {"a": 1.0, "b": 5.0}
    assert order == ["a", "b"] * 4  # a warm-up round, then three interleaved rounds
    with pytest.raises(ValueError, match="repeats"):
        roofline.interleaved_fastest(calls, repeats=0)
