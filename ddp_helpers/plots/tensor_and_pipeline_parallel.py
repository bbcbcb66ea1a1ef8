"""Lesson 11's figures, drawn in the parent from what the ranks returned: each pipeline schedule
as a timeline per rank (in slots and in wall time), and the bubble against the micro-batches."""

from __future__ import annotations

from matplotlib.patches import Patch

from ..lessons import tensor_and_pipeline_parallel as lesson
from .common import new_axes, rank_color

_ALPHA = {"F": 0.4, "B": 1.0}


def _boxes(ax, rows: list[list[tuple[str, int, float, float]]], unit: str) -> None:
    """One row per rank: a box per forward (light) and backward (dark), its micro-batch in it."""
    for rank, ops in enumerate(rows):
        for kind, i, start, end in ops:
            ax.barh(rank, end - start, left=start, height=0.8, color=rank_color(rank),
                    alpha=_ALPHA[kind], edgecolor="black", linewidth=0.5)
            ax.text((start + end) / 2, rank, f"{kind}{i}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)


def schedule_timelines(runs: list[list[dict]], m: int = 4):
    """GPipe and 1F1B with m micro-batches: top, the slots each op started in (from the order
    each rank ran); bottom, when it ran in wall time on this machine."""
    picked = [r for r in lesson.by_run(runs) if r[0]["m"] == m]
    fig, axes = new_axes(ncols=2, nrows=2, width=5.5, height=2.4)
    for col, per_rank in enumerate(picked):
        slots = lesson.slots_of(per_rank)
        _boxes(axes[0][col], [[(k, i, s, s + 1) for k, i, s in ops] for ops in slots],
               "slot (one forward or backward each)")
        start = min(t for r in per_rank for _, _, t, _ in r["ran"])
        _boxes(axes[1][col], [[(k, i, (a - start) * 1e3, (b - start) * 1e3)
                               for k, i, a, b in r["ran"]] for r in per_rank],
               "wall time (ms) from the step's first forward")
        name = per_rank[0]["schedule"].split(" ")[0]
        axes[0][col].set_title(f"{name}, {m} micro-batches: in slots")
        axes[1][col].set_title(f"{name}: as it ran here")
    handles = [Patch(facecolor=rank_color(r), label=f"rank {r}") for r in range(len(picked[0]))]
    handles += [Patch(facecolor="gray", alpha=_ALPHA[k], label=label)
                for k, label in (("F", "forward"), ("B", "backward"))]
    axes[0][1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def bubble_plot(runs: list[list[dict]]):
    """Idle fraction against micro-batches: counted in slots (every rank alike, black), and
    measured in wall time on each rank (its colour), for each schedule."""
    fig, axes = new_axes(ncols=2, width=4.8, height=3.4, sharey=True)
    for col, name in enumerate(("GPipe", "1F1B")):
        ax = axes[0][col]
        chosen = [r for r in lesson.by_run(runs) if r[0]["schedule"].startswith(name)]
        ms = [r[0]["m"] for r in chosen]
        ax.plot(ms, [lesson.bubble_from_slots(lesson.slots_of(r)) for r in chosen], "ks-",
                label="counted in slots (every rank)")
        for rank in range(len(chosen[0])):
            idle = []
            for per_rank in chosen:
                start = min(t for r in per_rank for _, _, t, _ in r["ran"])
                end = max(t for r in per_rank for _, _, _, t in r["ran"])
                busy = sum(b - a for _, _, a, b in per_rank[rank]["ran"])
                idle.append(1 - busy / (end - start))
            ax.plot(ms, idle, "o--", color=rank_color(rank), label=f"rank {rank}, wall time")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([str(m) for m in ms])
        ax.set_ylim(0, 1)
        ax.set_xlabel("micro-batches m")
        ax.set_title(f"{name}: idle fraction of the step")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("idle fraction")
    fig.tight_layout()
    return fig
