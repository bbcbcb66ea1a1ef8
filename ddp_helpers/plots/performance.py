"""Lesson 07's figures: per-rank step-time bars, all-reduce bandwidth, scaling."""

from __future__ import annotations

from matplotlib.patches import Patch

from ..lessons.performance import PHASES, phase_medians
from .common import new_axes, rank_color

PHASE_COLORS = {"data": "#9e9e9e", "forward": "#8ecae6", "backward": "#219ebc",
                "all-reduce wait": "#d62828", "optimizer": "#ffb703"}


def step_phase_bars(runs: dict[str, list[dict]], title: str = "Where one step's time goes"):
    """Stacked median phase times, one bar per rank (edge in the rank's colour) per run."""
    fig, axes = new_axes(width=9.0, height=4.0)
    ax = axes[0][0]
    ticks, labels, x = [], [], 0.0
    for run_name, records in runs.items():
        for rank, medians in enumerate(phase_medians(records)):
            bottom = 0.0
            for phase in PHASES:
                ms = medians[phase] * 1000
                ax.bar(x, ms, bottom=bottom, width=0.8, color=PHASE_COLORS[phase],
                       edgecolor=rank_color(rank), linewidth=2.0)
                bottom += ms
            ticks.append(x)
            labels.append(f"rank {rank}\n{run_name}" if rank == 0 else f"rank {rank}")
            x += 1.0
        x += 0.6  # a gap between runs
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    for tick, label in zip(ax.get_xticklabels(), labels):
        tick.set_color(rank_color(int(label.split()[1])))
    ax.set_ylabel("median time per step (ms)")
    ax.set_title(title)
    handles = [Patch(facecolor=PHASE_COLORS[p], label=p) for p in reversed(PHASES)]
    world = max(len(r) for r in runs.values())
    handles += [Patch(facecolor="white", edgecolor=rank_color(r), linewidth=2, label=f"rank {r}")
                for r in range(world)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def bandwidth_plot(bw: dict):
    """algbw and busbw against message size, with the memory-copy bandwidth as the ceiling."""
    fig, axes = new_axes(width=7.0, height=4.0)
    ax = axes[0][0]
    sizes = bw["sizes_bytes"]
    ax.plot(sizes, bw["algbw"], "o-", color="tab:blue", label="algbw = size / time")
    ax.plot(sizes, bw["busbw"], "s--", color="tab:purple",
            label=f"busbw = algbw x 2(N-1)/N, N={bw['world_size']}")
    ax.axhline(bw["copy_gbps"], color="black", linestyle=":",
               label=f"memory copy on one rank ({bw['device']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-reduce message size (bytes)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title(f"all_reduce over {bw['backend']}, {bw['world_size']} ranks on {bw['device']}")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


def scaling_plot(throughputs: dict[str, dict[int, float]]):
    """Left: speed-up over one rank (dotted: perfect scaling). Right: scaling efficiency."""
    fig, axes = new_axes(ncols=2, width=5.0, height=3.8)
    left, right = axes[0]
    colors = ["tab:green", "tab:brown", "tab:cyan", "tab:olive"]
    width = 0.8 / max(1, len(throughputs))
    for i, (model, by_n) in enumerate(throughputs.items()):
        ns = sorted(by_n)
        base = by_n[ns[0]] / ns[0]  # samples/s per rank with the fewest ranks
        # Speed-up rather than samples/s: models thousands of times apart share one axis.
        left.plot(ns, [by_n[n] / base for n in ns], "o-", color=colors[i % 4], label=model)
        eff = [by_n[n] / (n * base) for n in ns]
        right.bar([n + (i - (len(throughputs) - 1) / 2) * width for n in ns], eff, width=width,
                  color=colors[i % 4], label=model)
    all_ns = sorted({n for by_n in throughputs.values() for n in by_n})
    left.plot(all_ns, all_ns, ":", color="black", label="perfect")
    left.set_xlabel("ranks")
    left.set_ylabel("speed-up = throughput(N) / throughput(1)")
    left.set_title("Speed-up over one rank")
    left.legend(fontsize=8)
    right.axhline(1.0, color="black", linestyle=":", linewidth=1)
    right.set_xlabel("ranks")
    right.set_ylabel("efficiency = thr(N) / (N x thr(1))")
    right.set_title("Scaling efficiency")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(all_ns)
    fig.tight_layout()
    return fig
