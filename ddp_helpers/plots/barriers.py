"""Figures for lesson 04, drawn in the parent from what the ranks returned."""

from __future__ import annotations

from matplotlib.patches import Patch

from .common import new_axes, rank_color


def barrier_timeline_plot(rows: list[dict]):
    """Per rank: working (solid), waiting in the barrier (hatched), and the moment all leave."""
    fig, axes = new_axes(width=8.0, height=1.0 + 0.7 * len(rows))
    ax = axes[0, 0]
    for row in rows:
        r = row["rank"]
        ax.barh(r, row["arrive"] - row["start"], left=row["start"], height=0.5,
                color=rank_color(r), label=f"rank {r}: working")
        ax.barh(r, row["leave"] - row["arrive"], left=row["arrive"], height=0.5,
                facecolor="white", edgecolor=rank_color(r), hatch="//")
        ax.plot([row["arrive"]], [r], "k|", markersize=18)
        ax.plot([row["leave"]], [r], "k>", markersize=6)
    release = max(row["arrive"] for row in rows)
    ax.axvline(release, color="gray", linestyle=":")
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//",
                         label="waiting in dist.barrier()"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks([row["rank"] for row in rows], [f"rank {row['rank']}" for row in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first rank started (| arrive, > leave)")
    ax.set_title("dist.barrier(): everyone leaves once the last rank has arrived")
    fig.tight_layout()
    return fig
