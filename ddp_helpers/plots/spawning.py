"""Lesson 02's figure: how long each start method takes to start ranks on this machine."""

from __future__ import annotations

import statistics

from .common import new_axes

# One colour per start method (not per rank: no rank is involved in this figure).
METHOD_COLORS = {"spawn": "tab:red", "forkserver": "tab:green", "fork": "tab:blue"}
METHOD_NOTES = {"spawn": "fresh interpreter,\nimports torch",
                "forkserver": "fork of a clean server\n(torch preloaded)",
                "fork": "copy of this kernel\n(unsafe with CUDA/threads)"}


def start_method_bars(seconds: dict[str, float | list[float]], nprocs: int = 2):
    """Bar chart: seconds to start nprocs processes and join them, per start method.

    A method given a list of rounds gets its median as the bar and its fastest to slowest
    round as a line through it."""
    fig, axes = new_axes(width=7.0, height=3.5)
    ax = axes[0, 0]
    methods = list(seconds)
    rounds = {m: sorted(v) if isinstance(v, list) else [v] for m, v in seconds.items()}
    medians = {m: statistics.median(r) for m, r in rounds.items()}
    bars = ax.bar(range(len(methods)), [medians[m] for m in methods],
                  color=[METHOD_COLORS.get(m, "tab:gray") for m in methods])
    for i, (bar, m) in enumerate(zip(bars, methods, strict=True)):
        bar.set_label(f"{m}: {METHOD_NOTES.get(m, '').replace(chr(10), ' ')}")
        if len(rounds[m]) > 1:  # the spread over rounds: fastest to slowest
            ax.vlines(i, rounds[m][0], rounds[m][-1], color="black", linewidth=1.5)
        ax.annotate(f"{medians[m]:.3f} s", (bar.get_x() + bar.get_width() / 2,
                                            rounds[m][-1]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods)
    ax.set_yscale("log")
    ax.set_ylim(top=max(r[-1] for r in rounds.values()) * 3)  # room for the labels
    ax.set_ylabel("seconds to start and join (log scale)")
    spread = " (median; line: fastest to slowest round)" if any(
        len(r) > 1 for r in rounds.values()) else ""
    ax.set_title(f"starting {nprocs} processes that do nothing{spread}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
