"""Lesson 05's figure comparing runs: where each rank's epoch went, for one and two ranks."""

from __future__ import annotations

import math

import numpy as np

from .common import new_axes, rank_color

_PARTS = [("data_s", "waiting for data", "tab:gray"), ("compute_s", "compute", "tab:olive"),
          ("sync_s", "gradient all-reduce", "tab:cyan")]


def epoch_time_plot(runs: dict[str, list[dict]],
                    title: str = "Where each rank's epoch went (same samples in every run)"):
    """One stacked bar per (run, rank): data, compute and gradient sync seconds, summed."""
    fig, axes = new_axes(width=7.5, height=1.0 + 0.55 * sum(len(r) for r in runs.values()))
    ax = axes[0][0]
    labelled = set()
    for name, results in runs.items():
        for r in results:
            left = 0.0
            for key, label, color in _PARTS:
                seconds = float(np.nansum(r[key]))
                measured = not all(math.isnan(v) for v in r[key])
                show = measured and label not in labelled
                labelled |= {label} if show else set()
                ax.barh(f"{name}: rank {r['rank']}", seconds, left=left, color=color,
                        label=label if show else None, edgecolor=rank_color(r["rank"]),
                        linewidth=2)
                left += seconds
    ax.invert_yaxis()  # the first run on top
    ax.set_xlabel("seconds in the epoch (summed over steps); bar edge: rank colour")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return fig
