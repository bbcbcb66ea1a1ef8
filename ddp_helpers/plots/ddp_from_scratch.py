"""Lesson 09's figures, drawn in the parent from what the ranks returned: step time per version
and rank, all-reduce time against size with the fitted line, and the bucket-size curve."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import FuncFormatter

from ..lessons import ddp_from_scratch as lesson
from .common import finish, new_axes, rank_color


def step_time_bars(times: list[dict[str, float]]):
    """Median step time of each version, one bar per rank in the rank's colour."""
    fig, axes = new_axes(width=8.0, height=3.6)
    ax = axes[0][0]
    names = list(times[0])
    width = 0.8 / len(times)
    for rank, per_rank in enumerate(times):
        x = np.arange(len(names)) + (rank - (len(times) - 1) / 2) * width
        ax.bar(x, [per_rank[n]["seconds"] * 1000 for n in names], width, color=rank_color(rank),
               label=f"rank {rank}")
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("One training step of the large TiedNet, per version and rank")
    ax.legend()
    fig.tight_layout()
    return fig


def allreduce_fit(sizes: list[int], seconds: list[list[float]], alpha: float,
                  bandwidth: float):
    """Each rank's all-reduce time against message size, and the fitted alpha + n/B."""
    fig, axes = new_axes(width=6.5, height=3.6)
    ax = axes[0][0]
    for rank, per_rank in enumerate(seconds):
        ax.plot(sizes, np.array(per_rank) * 1000, "o", color=rank_color(rank),
                label=f"rank {rank}, measured")
    n = np.logspace(np.log10(sizes[0]), np.log10(sizes[-1]), 100)
    ax.plot(n, (alpha + n / bandwidth) * 1000, "k--",
            label=f"alpha + n/B: alpha = {alpha * 1e6:.0f} us, B = {bandwidth / 1e9:.2f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    return finish(fig, ax, "all-reduce message size n (bytes)", "median time (ms)",
                  "all_reduce on this machine (gloo, loopback)", {"fontsize": 8})


def bucket_curve(sweeps: list[list[dict]], compute_s: float, alpha: float, bandwidth: float):
    """Measured step time against bucket cap per rank, the model's prediction, and b*."""
    fig, axes = new_axes(width=10.0, height=3.8)
    ax = axes[0][0]
    caps = [row["cap_mb"] for row in sweeps[0]]
    for rank, sweep in enumerate(sweeps):
        ax.plot(caps, [row["seconds"] * 1000 for row in sweep], "o-", color=rank_color(rank),
                label=f"rank {rank}, measured")
    for overlap, style, shown in ((True, "ks--", "last bucket / B"), (False, "k^:", "S / B")):
        model = [lesson.predicted_seconds(compute_s, alpha, bandwidth, row["bucket_bytes"],
                                          overlap) * 1000 for row in sweeps[0]]
        ax.plot(caps, model, style, label=f"model {'with' if overlap else 'without'} overlap: "
                                          f"compute + alpha x buckets + {shown}")
    total = sum(sweeps[0][0]["bucket_bytes"])
    best = lesson.best_bucket_bytes(alpha, bandwidth, total) / 2**20
    ax.axvline(best, color="gray", ls="-.", label=f"b* = sqrt(alpha R S), R ~ B = {best:.2g} MiB")
    for cap, row in zip(caps, sweeps[0]):
        ax.annotate(f"{len(row['bucket_bytes'])}", (cap, 1), xycoords=("data", "axes fraction"),
                    textcoords="offset points", xytext=(0, 3), ha="center", va="bottom",
                    fontsize=8)  # above the axes: inside, a count sat on the tallest points
    ax.set_xscale("log")
    ax.set_xlabel("bucket cap (MiB); the numbers at the top: buckets")
    ax.set_ylabel("median step time (ms)")
    ax.set_title("Bucketed DDP: step time against bucket size", pad=16)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
