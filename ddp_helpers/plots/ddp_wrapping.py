"""Figures for lesson 03, drawn in the parent from what the ranks returned (`%%ranks --return`)."""

from __future__ import annotations

from matplotlib.patches import Patch, Rectangle

from .common import finish, new_axes, rank_color


def gradient_sync_plot(local: list, synced: list):
    """Each rank's own gradient (from a backward under no_sync) next to the averaged one that
    DDP's backward leaves on every rank; `local` and `synced` hold one flat tensor per rank."""
    fig, axes = new_axes(width=8.0, height=3.2)
    ax = axes[0, 0]
    for rank, grad in enumerate(local):
        ax.plot(grad.numpy(), "o", markersize=4, color=rank_color(rank),
                label=f"rank {rank}: its own gradient (no_sync)")
    ax.plot(synced[0].numpy(), color="black", linewidth=1.2,
            label="every rank after DDP's backward (the mean)")
    return finish(fig, ax, "parameter index (all tensors flattened)", "gradient",
                  "backward all-reduces and averages the gradients", {"fontsize": 8})


def sampler_assignment_plot(without_set_epoch: list[list[list[int]]],
                            with_set_epoch: list[list[list[int]]]):
    """Which rank gets each dataset index in each epoch; numbers give the order within a rank.
    Each argument holds, per rank, the index list of every epoch."""
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
