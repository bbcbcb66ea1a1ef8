"""Lesson 12's figure: the sample indices each rank's sampler gave in each epoch, drawn in the
parent from what the ranks returned."""

from __future__ import annotations

from .common import finish, new_axes, rank_color


def epoch_orders_plot(orders: list[list[list[int]]], title: str):
    """orders[rank][epoch] = that rank's indices in that epoch: one row per epoch, each index
    at its position in the epoch, one colour per rank."""
    fig, axes = new_axes(width=7.0, height=3.0)
    ax = axes[0][0]
    for rank, epochs in enumerate(orders):
        for epoch, indices in enumerate(epochs):
            ax.plot(range(len(indices)), indices, marker="o", color=rank_color(rank),
                    alpha=0.4 + 0.3 * epoch / max(1, len(epochs) - 1),
                    label=f"rank {rank}" if epoch == 0 else None)
    return finish(fig, ax, "position in the epoch", "sample index", title,
                  {"loc": "upper right", "fontsize": 8})
