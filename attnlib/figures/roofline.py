"""The roofline plot of chapter 10: two measured ceilings and the kernels placed under them."""

import numpy as np

from ..lab.roofline import attainable, ridge


def plot_roofline(ax, peak_gflops, bandwidth_gbs, points, intensities=(0.05, 1e4)):
    """Draw eq. 10.3, min(peak, I * bandwidth), on log-log axes and each {label: (I, GFLOP/s)}.

    Returns the axes. The ridge, where the ceilings meet, is marked with a dotted line.
    """
    grid = np.geomspace(*intensities, 200)
    roof = [attainable(i, peak_gflops, bandwidth_gbs) for i in grid]
    ax.loglog(grid, roof, "k-", linewidth=2)
    ax.axvline(ridge(peak_gflops, bandwidth_gbs), color="k", linestyle=":", linewidth=1)
    ax.text(
        intensities[0] * 1.3,
        intensities[0] * 1.6 * bandwidth_gbs,
        f"memory: {bandwidth_gbs:.0f} GB/s",
        rotation=0,
        fontsize=8,
    )
    ax.text(
        intensities[1] / 1.3,
        peak_gflops * 1.15,
        f"matmul: {peak_gflops:.0f} GFLOP/s",
        ha="right",
        fontsize=8,
    )
    for label, (intensity, rate) in points.items():
        ax.plot(intensity, rate, "o", label=label)
    ax.set(
        xlabel="FLOPs per byte moved (eq. 10.2)",
        ylabel="GFLOP/s",
        ylim=(None, peak_gflops * 2),
    )
    ax.legend(fontsize=8, loc="lower right")
    return ax
