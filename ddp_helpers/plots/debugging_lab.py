"""Lesson 12's figure: the sample indices each rank's sampler gave in each epoch, drawn in the
parent from what the ranks returned."""

from __future__ import annotations

from .common import finish, new_axes, rank_color


def epoch_orders_plot(orders: list[list[list[int]]], title: str):
    """orders[rank][epoch] = that rank's indices in that epoch: one line per epoch, each
    index at its position in the epoch, one colour per rank, one marker per epoch. Each epoch
    is shifted a little to the right, so that epochs in the same order show as parallel lines
    rather than one."""
    fig, axes = new_axes(width=7.0, height=3.0)
    ax = axes[0][0]
    markers = "osD^v<>"
    for rank, epochs in enumerate(orders):
        for epoch, indices in enumerate(epochs):
            shift = 0.08 * epoch  # apart enough to see, far from the next position
            ax.plot([i + shift for i in range(len(indices))], indices,
                    marker=markers[epoch % len(markers)], color=rank_color(rank), alpha=0.7,
                    label=f"rank {rank}, epoch {epoch}")
    longest = max((len(e) for epochs in orders for e in epochs), default=0)
    ax.set_xticks(range(longest))  # positions are whole numbers
    return finish(fig, ax, "position in the epoch (each epoch shifted a little)", "sample index",
                  title, {"loc": "upper left", "fontsize": 7, "ncol": 2,
                          "bbox_to_anchor": (1.01, 1.0)})
