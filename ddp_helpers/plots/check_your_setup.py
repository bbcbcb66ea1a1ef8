"""Lesson 00's figure: each rank's tensor before and after the all-reduce."""

from __future__ import annotations

from .common import new_axes, rank_color


def before_after_plot(results: list[dict]):
    """One bar per rank before all_reduce (rank + 1) and after (the sum, the same everywhere)."""
    fig, axes = new_axes(ncols=2, width=4.0, height=2.8)
    for ax, key, title in zip(axes[0], ("before", "result"), ("before all_reduce",
                                                                 "after all_reduce (SUM)")):
        for r in results:
            ax.bar(r["rank"], r[key][0].item(), color=rank_color(r["rank"]),
                   label=f"rank {r['rank']}")
        ax.set_title(title)
        ax.set_xlabel("rank")
        ax.set_ylabel("value in every element")
        ax.set_xticks([r["rank"] for r in results])
    axes[0][0].legend()
    fig.tight_layout()
    return fig
