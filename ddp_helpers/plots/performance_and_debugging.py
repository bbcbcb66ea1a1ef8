"""Lesson 07's figures: per-rank step phases, a bucket timeline, a bucket-size sweep, all-reduce
bandwidth against its references, and scaling. All drawn in the parent from returned records."""

from __future__ import annotations

from matplotlib.patches import Patch

from ..lessons.performance_and_debugging import PHASES, exposed_spans, overlap, phase_medians
from .common import new_axes, rank_color, rank_ticks

PHASE_COLORS = {"data": "#9e9e9e", "forward": "#8ecae6", "backward": "#219ebc",
                "all-reduce wait": "#d62828", "optimizer": "#ffb703"}
LANE_COLORS = {"forward": "#8ecae6", "compute": "#219ebc", "all-reduce": "#d62828"}


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
    rank_ticks(ax, "x", ticks, labels)
    ax.set_ylabel("median time per step (ms)")
    ax.set_title(title)
    handles = [Patch(facecolor=PHASE_COLORS[p], label=p) for p in reversed(PHASES)]
    world = max(len(r) for r in runs.values())
    handles += [Patch(facecolor="white", edgecolor=rank_color(r), linewidth=2, label=f"rank {r}")
                for r in range(world)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def timeline_plot(records: list[dict], step: int = 0,
                  title: str = "One DDP step: backward against each bucket's all-reduce"):
    """Per rank, two lanes of one profiled step: compute (forward light, backward dark) and
    all-reduce; the all-reduce time with no backward beside it (the exposed wait) is hatched."""
    fig, axes = new_axes(width=10.0, height=1.2 + 0.9 * len(records))
    ax = axes[0][0]
    ticks, labels = [], []
    for i, rec in enumerate(records):
        events = [e for e in rec["events"] if e["step"] == step]
        base = 3 * (len(records) - 1 - i)  # rank 0 on top
        for row, lanes in ((0, ("all-reduce",)), (1, ("forward", "compute"))):
            for lane in lanes:
                spans = [(e["start"] * 1e3, (e["end"] - e["start"]) * 1e3)
                         for e in events if e["lane"] == lane]
                ax.broken_barh(spans, (base + row, 0.8), facecolors=LANE_COLORS[lane],
                               edgecolors=rank_color(rec["rank"]), linewidth=0.5)
            ticks.append(base + row + 0.4)
            labels.append(f"rank {rec['rank']} {'all-reduce' if row == 0 else 'compute'}")
        for a, b in exposed_spans(events):
            ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (base, 0.8), facecolors="none",
                           hatch="///", edgecolors="black", linewidth=0)
    rank_ticks(ax, "y", ticks, labels)
    ax.set_xlabel("ms since the profiled steps started (both ranks left a barrier together)")
    ax.set_title(title)
    ax.legend(handles=[Patch(facecolor=LANE_COLORS["forward"], label="forward"),
                       Patch(facecolor=LANE_COLORS["compute"], label="backward ops"),
                       Patch(facecolor=LANE_COLORS["all-reduce"], label="bucket all-reduce"),
                       Patch(facecolor="white", hatch="///", edgecolor="black",
                             label="exposed: no backward beside it")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def bucket_sweep_plot(sweep: dict[float, list[dict]]):
    """Left: median step time per rank against bucket_cap_mb, over the profiled steps (the ones
    `lesson.sweep_summary` prints). Right: the exposed share of the all-reduce in those steps.
    Each point is labelled with its bucket count."""
    import statistics

    fig, axes = new_axes(ncols=2, width=5.0, height=3.6)
    left, right = axes[0]
    caps = sorted(sweep)
    for rank in range(len(sweep[caps[0]])):
        ms = [statistics.median(sweep[c][rank]["profiled_step_seconds"]) * 1e3 for c in caps]
        ratio = [overlap(sweep[c][rank]["events"])["exposed_ratio"] for c in caps]
        left.plot(caps, ms, "o-", color=rank_color(rank), label=f"rank {rank}")
        right.plot(caps, ratio, "o-", color=rank_color(rank), label=f"rank {rank}")
    for c in caps:  # the bucket count above each point of rank 0
        n = sweep[c][0]["buckets"]
        for ax, y in ((left, statistics.median(sweep[c][0]["profiled_step_seconds"]) * 1e3),
                      (right, overlap(sweep[c][0]["events"])["exposed_ratio"])):
            ax.annotate(f"{n} bucket{'s' if n > 1 else ''}", (c, y), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("bucket_cap_mb")
        ax.legend(fontsize=8)
    left.set_ylabel("median profiled step (ms)")
    left.set_title("Step time")
    right.set_ylabel("exposed all-reduce / all-reduce")
    right.set_ylim(0, 1.05)
    right.set_title("Share of the all-reduce not hidden")
    fig.tight_layout()
    return fig


def bandwidth_plot(bw: dict):
    """algbw and busbw against message size, with the copies measured in the same run."""
    fig, axes = new_axes(width=7.0, height=4.0)
    ax = axes[0][0]
    sizes = bw["sizes_bytes"]
    ax.plot(sizes, bw["algbw"], "o-", color="tab:blue", label="algbw = size / time")
    ax.plot(sizes, bw["busbw"], "s--", color="tab:purple",
            label=f"busbw = algbw x 2(N-1)/N, N={bw['world_size']}")
    where = "main memory" if bw["device"] == "cpu" else "the GPU's own memory: not a link"
    ax.axhline(bw["copy_gbps"], color="black", linestyle=":",
               label=f"copy within rank 0's {bw['device']} ({where})")
    if bw.get("link_gbps"):
        peer = "on" if bw["peer_access"] else "off"
        ax.axhline(bw["link_gbps"], color="tab:red", linestyle="-.",
                   label=f"cuda:0 -> cuda:1 copy, the link (peer access {peer})")
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
