"""Figures for lesson 03, drawn in the parent from what the ranks returned."""

from __future__ import annotations

from matplotlib.patches import Patch, Rectangle

from .common import new_axes, rank_color


def weights_before_after_plot(records: list[dict]):
    """Each rank's flattened parameters before and after the DDP constructor."""
    fig, axes = new_axes(ncols=2, width=5.0, height=3.2, sharey=True)
    for ax, key, title in ((axes[0, 0], "before", "before DDP(model)"),
                           (axes[0, 1], "after", "after DDP(model)")):
        for rank, rec in enumerate(records):
            # Later ranks dashed and thinner, so identical lines stay visible on top of each other
            ax.plot(rec[key].numpy(), color=rank_color(rank), label=f"rank {rank}",
                    linestyle="-" if rank == 0 else "--", linewidth=2.5 if rank == 0 else 1.5)
        ax.set_title(title)
        ax.set_xlabel("parameter index (all tensors flattened)")
    axes[0, 0].set_ylabel("value")
    axes[0, 1].legend()
    fig.tight_layout()
    return fig


def gradient_sync_plot(records: list[dict]):
    """Each rank's own gradient (no sync) next to the averaged one DDP's backward leaves."""
    fig, axes = new_axes(width=8.0, height=3.2)
    ax = axes[0, 0]
    for rank, rec in enumerate(records):
        ax.plot(rec["local"].numpy(), "o", markersize=4, color=rank_color(rank),
                label=f"rank {rank}: own gradient (no_sync)")
    ax.plot(records[0]["synced"].numpy(), color="black", linewidth=1.2,
            label="every rank after DDP backward (the mean)")
    ax.set_title("backward all-reduces and averages the gradients")
    ax.set_xlabel("parameter index (all tensors flattened)")
    ax.set_ylabel("gradient")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def sampler_assignment_plot(without_set_epoch: list[list[list[int]]],
                            with_set_epoch: list[list[list[int]]]):
    """Which rank gets each dataset index in each epoch; numbers give the order within a rank."""
    fig, axes = new_axes(ncols=2, width=5.5, height=2.6)
    for ax, per_rank, title in ((axes[0, 0], without_set_epoch, "without set_epoch"),
                                (axes[0, 1], with_set_epoch, "with set_epoch(epoch)")):
        epochs = len(per_rank[0])
        size = sum(len(per_rank[r][0]) for r in range(len(per_rank)))
        for rank, epochs_indices in enumerate(per_rank):
            for epoch, indices in enumerate(epochs_indices):
                for order, index in enumerate(indices):
                    ax.add_patch(_cell(index, epoch, rank_color(rank)))
                    ax.text(index + 0.5, epoch + 0.5, str(order), ha="center", va="center",
                            fontsize=7, color="white")
        ax.set_xlim(0, size)
        ax.set_ylim(epochs, 0)
        ax.set_yticks([e + 0.5 for e in range(epochs)], [f"epoch {e}" for e in range(epochs)])
        ax.set_xticks([i + 0.5 for i in range(size)], [str(i) for i in range(size)], fontsize=7)
        ax.set_xlabel("dataset index (cell text: position in that rank's epoch)")
        ax.set_title(title)
    handles = [Patch(color=rank_color(r), label=f"rank {r}") for r in range(len(with_set_epoch))]
    axes[0, 1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def _cell(x: int, y: int, color: str) -> Rectangle:
    return Rectangle((x, y), 1, 1, facecolor=color, edgecolor="white")


def bucket_plot(records: list[list[dict]]):
    """All-reduce calls per backward and time per step against bucket_cap_mb, per rank."""
    fig, axes = new_axes(ncols=2, width=4.8, height=3.2)
    caps = [str(r["bucket_cap_mb"]) for r in records[0]]
    width = 0.8 / len(records)
    for rank, recs in enumerate(records):
        xs = [i + (rank - (len(records) - 1) / 2) * width for i in range(len(caps))]
        axes[0, 0].bar(xs, [r["calls"][-1] for r in recs], width, color=rank_color(rank),
                       label=f"rank {rank}")
        axes[0, 1].bar(xs, [1000 * r["seconds_per_step"] for r in recs], width,
                       color=rank_color(rank), label=f"rank {rank}")
    for ax, ylabel, title in ((axes[0, 0], "all-reduce calls", "calls per backward"),
                              (axes[0, 1], "ms", "forward + backward time per step")):
        ax.set_xticks(range(len(caps)), caps)
        ax.set_xlabel("bucket_cap_mb")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    return fig
