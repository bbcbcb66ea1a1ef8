"""What every figure shares: one colour per rank, fixed sizes, labelled axes."""

from __future__ import annotations

import matplotlib.pyplot as plt

_RANK_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                "tab:pink", "tab:gray"]


def rank_color(rank: int) -> str:
    """The colour rank r has in every figure of the kit."""
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def new_axes(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 3.5,
             **kwargs):
    """A figure of a fixed size with a grid of axes (fixed sizes keep nbval's text stable)."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows),
                             squeeze=False, **kwargs)
    return fig, axes


def rank_ticks(ax, axis: str, positions: list[float], labels: list[str]) -> None:
    """Label `axis` ("x" or "y") with per-rank labels ("rank r ..."), each in its rank's colour."""
    getattr(ax, f"set_{axis}ticks")(positions)
    getattr(ax, f"set_{axis}ticklabels")(labels, fontsize=8)
    for tick, label in zip(getattr(ax, f"get_{axis}ticklabels")(), labels):
        tick.set_color(rank_color(int(label.split()[1])))


def finish(fig, ax, xlabel: str, ylabel: str, title: str, legend: dict | None = None):
    """Label the axes, title and legend (kwargs to `ax.legend`), tighten, return the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(**(legend or {}))
    fig.tight_layout()
    return fig
