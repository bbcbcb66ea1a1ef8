"""Lesson 08's figures: one training run launched several ways, and a run killed and resumed."""

from __future__ import annotations

from .common import finish, new_axes, rank_color


def loss_by_launcher(runs: dict[str, dict[int, list[float]]]):
    """One panel per way of launching: each rank's loss per step, the same axes for all."""
    fig, axes = new_axes(ncols=len(runs), width=4.0, height=3.2, sharey=True)
    for ax, (way, by_rank) in zip(axes[0], runs.items()):
        for rank, losses in by_rank.items():
            ax.plot(range(1, len(losses) + 1), losses, color=rank_color(rank), lw=1.5,
                    label=f"rank {rank}")
        ax.set_title(way, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("training loss (this rank's batch)")
    fig.suptitle(f"The same function, launched {len(runs)} ways: the same curves")
    fig.tight_layout()
    return fig


def loss_through_restart(records: list[dict], uninterrupted: dict[int, list[float]] | None = None):
    """Each rank's loss per step and attempt; the checkpoint resumed from; the steps redone."""
    fig, axes = new_axes(width=7.0, height=3.6)
    ax = axes[0][0]
    if uninterrupted:
        for rank, losses in uninterrupted.items():
            ax.plot(range(1, len(losses) + 1), losses, color="lightgray", lw=5, zorder=0,
                    label="uninterrupted run" if rank == 0 else None)
    styles = {0: ("-", "o"), 1: ("--", "s")}
    for rec in records:
        ls, marker = styles.get(rec["attempt"], (":", "^"))
        ax.plot(rec["steps"], rec["loss"], color=rank_color(rec["rank"]), ls=ls, marker=marker,
                ms=3, lw=1.2, label=f"rank {rec['rank']}, attempt {rec['attempt']}")
    for rec in records:
        if rec["attempt"] > 0 and rec["rank"] == 0:
            before = max((r["steps"][-1] for r in records
                          if r["attempt"] == rec["attempt"] - 1 and r["steps"]), default=0)
            start = rec["resumed_from"]
            ax.axvspan(start + 0.5, before + 0.5, color="gold", alpha=0.3,
                       label=f"redone: steps {start + 1}-{before}")
            ax.axvline(start + 0.5, color="black", ls=":", lw=1,
                       label=f"checkpoint of step {start}")
            ax.axvline(before + 1, color="red", lw=1, label=f"rank killed at step {before + 1}")
    return finish(fig, ax, "step", "training loss (this rank's batch)",
                  "A rank killed, the group restarted by torchrun, training resumed",
                  {"fontsize": 7, "ncol": 2})
