"""The roofline helpers of chapter 10: the ceilings' arithmetic, the bandwidth probe, the plot."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attnlib.figures.roofline import plot_roofline  # noqa: E402
from attnlib.lab.roofline import attainable, read_bandwidth, ridge  # noqa: E402


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
