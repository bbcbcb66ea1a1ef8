"""Lesson 10's figures, drawn in the parent from what the ranks returned: memory per rank against
the formulas, the loss curves of four ways to train, and compression's bytes against accuracy."""

from __future__ import annotations

from matplotlib.patches import Patch

from ..lessons import sharding_and_compression as lesson
from .common import finish, new_axes, rank_color

PARTS = ("parameters", "gradients", "optimizer", "copies")
PART_COLORS = {"parameters": "#8ecae6", "gradients": "#219ebc", "optimizer": "#ffb703",
               "copies": "#d9d9d9"}
_DASHES = ["-", "--", ":", "-."]


def memory_bars(runs: list[list[dict]]):
    """Stacked KiB per part, one bar per rank (edge in the rank's colour) for each way of
    training; a black tick marks the formula's total."""
    fig, axes = new_axes(width=9.0, height=4.0)
    ax = axes[0][0]
    formulas = lesson.formulas(lesson.param_count(lesson.mlp()), len(runs))
    ticks, labels, x, top = [], [], 0.0, 0.0
    for i, first in enumerate(runs[0]):
        want = sum(formulas[first["kind"].split(" ")[0]].values()) / 1024
        for rank, per_rank in enumerate(runs):
            bottom = 0.0
            for part in PARTS:
                kib = per_rank[i]["memory"][part] / 1024
                ax.bar(x, kib, bottom=bottom, color=PART_COLORS[part],
                       edgecolor=rank_color(rank), linewidth=2)
                bottom += kib
            top = max(top, bottom, want)
            ax.plot([x - 0.4, x + 0.4], [want, want], color="black", lw=2)
            ticks.append(x)
            labels.append(f"{first['kind']}\nrank {rank}" if rank == 0 else f"rank {rank}")
            x += 1.0
        x += 0.6
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylim(0, 1.1 * top)
    ax.set_ylabel("KiB held by the rank")
    ax.set_title("Memory per rank: parameters, gradients, Adam state (black: the formula)")
    handles = [Patch(facecolor=PART_COLORS[p], label=p) for p in reversed(PARTS)]
    handles += [Patch(facecolor="white", edgecolor=rank_color(r), linewidth=2, label=f"rank {r}")
                for r in range(len(runs))]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def loss_curves(runs: list[list[dict]]):
    """Each rank's loss per step for each way of training: one dash per way, one colour per
    rank; equal runs draw on top of each other."""
    fig, axes = new_axes(width=7.0, height=3.6)
    ax = axes[0][0]
    for i, first in enumerate(runs[0]):
        for rank, per_rank in enumerate(runs):
            losses = per_rank[i]["losses"]
            ax.plot(range(1, len(losses) + 1), losses, _DASHES[i % 4], color=rank_color(rank),
                    lw=3 - 0.6 * i, label=f"{first['kind']}, rank {rank}")
    return finish(fig, ax, "step", "loss on the rank's own batch",
                  "Four ways to train: the curves lie on top of each other",
                  {"fontsize": 7, "ncol": 2})


def compression_plot(runs: list[list[dict]]):
    """Left: each rank's loss per step for each hook; right: accuracy after the budget
    against the bytes each rank put into all-reduces."""
    fig, axes = new_axes(ncols=2, width=5.0, height=3.6)
    ax_loss, ax_acc = axes[0]
    for i, first in enumerate(runs[0]):
        for rank, per_rank in enumerate(runs):
            ax_loss.plot(per_rank[i]["losses"], _DASHES[i % 4], color=rank_color(rank),
                         label=f"{first['hook']}, rank {rank}")
            ax_acc.scatter(per_rank[i]["bytes"] / 2**20, per_rank[i]["accuracy"],
                           color=rank_color(rank), marker="o" if rank == 0 else "x",
                           label=f"rank {rank}" if i == 0 else None)
        ax_acc.annotate(first["hook"], (first["bytes"] / 2**20, first["accuracy"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss on the rank's own batch")
    ax_loss.set_title("Loss per hook and rank")
    ax_loss.legend(fontsize=6, ncol=2)
    ax_acc.set_xscale("log")
    ax_acc.set_xlabel("MiB each rank all-reduced over the budget")
    ax_acc.set_ylabel("held-out accuracy")
    ax_acc.set_title(f"After {lesson.COMPRESS_STEPS} steps")
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    return fig
