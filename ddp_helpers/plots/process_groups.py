"""Lesson 01's figures, drawn in the parent from what the ranks returned: every rank's tensor
before and after a collective, a barrier's arrivals, the ring's steps, and timings."""

from __future__ import annotations

import torch
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, NullFormatter

from .common import new_axes, rank_color

MIXED = "lightgray"  # a value combined from several ranks belongs to none of them

# Where each value after a collective came from: a rank, "chunks" (chunk k from rank k),
# or "mixed" (a reduction of every rank's values).
AFTER_ORIGIN = {
    "broadcast": 0, "scatter": 0,
    "all_gather": "chunks", "gather": "chunks",
    "all_reduce SUM": "mixed", "all_reduce AVG": "mixed", "all_reduce MAX": "mixed",
    "reduce": "mixed", "reduce_scatter": "mixed",
}


def _label(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e4 else f"{v:.2e}"


def _draw_rows(ax, tensors: list, origin, chunk: int, none_text: str, width: int) -> None:
    """Draw rank r's tensor as row r of labelled boxes coloured by where each value came from."""
    for r, t in enumerate(tensors):
        y = len(tensors) - 1 - r  # rank 0 on top
        if t is None:
            ax.text(0.1, y + 0.4, none_text, va="center", fontsize=9, style="italic",
                    color="gray")
            continue
        for i, v in enumerate(t.flatten().tolist()):
            if origin == "mixed":
                face = MIXED
            elif origin == "chunks":
                face = rank_color(i // chunk)
            elif origin == "own":
                face = rank_color(r)
            else:
                face = rank_color(origin)
            ax.add_patch(Rectangle((i, y), 0.92, 0.8, facecolor=face, alpha=0.45,
                                   edgecolor="black", linewidth=0.6))
            ax.text(i + 0.46, y + 0.4, _label(v), ha="center", va="center", fontsize=9)
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-0.2, len(tensors))
    ax.set_yticks([len(tensors) - 1 - r + 0.4 for r in range(len(tensors))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(tensors))])
    for r, tick in enumerate(ax.get_yticklabels()):
        tick.set_color(rank_color(r))
    ax.set_xticks([])
    ax.set_xlabel("tensor elements")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def before_after(name: str, before: list, after: list):
    """Two panels: each rank's tensor before and after collective `name`, one row per rank."""
    world_size = len(before)
    width = max(len(t.flatten()) for t in before + after if t is not None)
    fig, axes = new_axes(ncols=2, width=5.0, height=0.55 * world_size + 1.3)
    longest_after = max(len(t.flatten()) for t in after if t is not None)
    chunk = max(1, longest_after // world_size)  # all_gather/gather: chunk k is rank k's
    _draw_rows(axes[0, 0], before, "own", chunk, "(only a receive buffer)", width)
    _draw_rows(axes[0, 1], after, AFTER_ORIGIN.get(name, "mixed"), chunk,
               "(no result here)", width)
    axes[0, 0].set_title("before")
    axes[0, 1].set_title("after")
    handles = [Patch(facecolor=rank_color(r), alpha=0.45, label=f"rank {r}'s values")
               for r in range(world_size)]
    if AFTER_ORIGIN.get(name, "mixed") == "mixed":
        handles.append(Patch(facecolor=MIXED, alpha=0.45, label="combined from all ranks"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.suptitle(f"{name} on {world_size} ranks")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def barrier_timeline(arrived: list[float], left: list[float]):
    """When each rank reached dist.barrier() and when it was let through (wall-clock seconds,
    comparable between processes on one machine)."""
    origin = min(arrived)
    fig, axes = new_axes(width=7.0, height=0.5 * len(arrived) + 1.5)
    ax = axes[0, 0]
    for r, (a, b) in enumerate(zip(arrived, left, strict=True)):
        a, b = a - origin, b - origin
        ax.barh(r, b - a, left=a, color=rank_color(r), alpha=0.45, label=f"rank {r} waiting")
        ax.plot([a], [r], "o", color=rank_color(r))
        ax.plot([b], [r], "|", color="black", markersize=14)
    ax.set_yticks(range(len(arrived)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(arrived))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first rank arrived (dot: arrived, bar end: left)")
    ax.set_title("barrier: everyone leaves once the last rank has arrived")
    ax.set_xlim(-0.03, max(b - origin for b in left) * 1.15 + 0.01)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    return fig


def ring_steps(steps_per_rank: list[list]):
    """Each rank's tensor after every step of the ring all-reduce, coloured by how done it is."""
    world_size = len(steps_per_rank)
    n_steps = len(steps_per_rank[0])
    final = steps_per_rank[0][-1]
    width = len(final)
    fig, axes = new_axes(ncols=n_steps, width=2.6, height=0.55 * world_size + 1.6)
    names = (["start"] + [f"reduce-scatter {s + 1}" for s in range(world_size - 1)]
             + [f"all-gather {s + 1}" for s in range(world_size - 1)])
    for s in range(n_steps):
        ax = axes[0, s]
        for r in range(world_size):
            y = world_size - 1 - r
            now = steps_per_rank[r][s]
            own = steps_per_rank[r][0]
            for i, v in enumerate(now.tolist()):
                if torch.equal(now[i], final[i]):
                    face, alpha = "black", 0.55
                elif torch.equal(now[i], own[i]):
                    face, alpha = rank_color(r), 0.45
                else:
                    face, alpha = MIXED, 0.9
                ax.add_patch(Rectangle((i, y), 0.92, 0.8, facecolor=face, alpha=alpha,
                                       edgecolor="black", linewidth=0.6))
                ax.text(i + 0.46, y + 0.4, _label(v), ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.1, width + 0.1)
        ax.set_ylim(-0.2, world_size)
        ax.set_xticks([])
        ax.set_yticks([world_size - 1 - r + 0.4 for r in range(world_size)])
        ax.set_yticklabels([f"rank {r}" if s == 0 else "" for r in range(world_size)])
        for r, tick in enumerate(ax.get_yticklabels()):
            tick.set_color(rank_color(r))
        ax.set_title(names[s], fontsize=9)
        ax.set_xlabel("elements")
    handles = ([Patch(facecolor=rank_color(r), alpha=0.45, label=f"rank {r}'s own value")
                for r in range(world_size)]
               + [Patch(facecolor=MIXED, label="partial sum"),
                  Patch(facecolor="black", alpha=0.55, label="full sum")])
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.suptitle(f"ring all-reduce on {world_size} ranks, {width} elements "
                 f"({world_size} chunks)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def timing_bars(timings: dict, world_size: int):
    """Median seconds per all-reduce, grouped by tensor size, one bar per implementation
    (`timings[size][implementation]`, one rank's)."""
    sizes = list(timings)
    impls = list(timings[sizes[0]])
    fig, axes = new_axes(width=7.0, height=3.5)
    ax = axes[0, 0]
    bar = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        xs = [i + j * bar for i in range(len(sizes))]
        ax.bar(xs, [timings[s][impl] * 1e3 for s in sizes], width=bar, label=impl,
               color=["tab:cyan", "tab:gray", "tab:olive"][j % 3])
    ax.set_xticks([i + bar * (len(impls) - 1) / 2 for i in range(len(sizes))])
    ax.set_xticklabels([f"{s:,} floats" for s in sizes])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())  # "3x10^0" labels help nobody
    ax.set_ylabel("milliseconds per all-reduce (median)")
    ax.set_title(f"a Python ring vs the backend's all_reduce, {world_size} ranks "
                 "(rank 0's timings)")
    ax.legend()
    fig.tight_layout()
    return fig

