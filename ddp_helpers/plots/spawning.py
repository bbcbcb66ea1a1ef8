"""Lesson 02's figure: how long each start method takes to start ranks on this machine."""

from __future__ import annotations

from .common import new_axes

# One colour per start method (not per rank: no rank is involved in this figure).
METHOD_COLORS = {"spawn": "tab:red", "forkserver": "tab:green", "fork": "tab:blue"}
METHOD_NOTES = {"spawn": "fresh interpreter,\nimports torch",
                "forkserver": "fork of a clean server\n(torch preloaded)",
                "fork": "copy of this kernel\n(unsafe with CUDA/threads)"}


def start_method_bars(seconds: dict[str, float], nprocs: int = 2):
    """Bar chart: seconds to start nprocs processes and join them, per start method."""
    fig, axes = new_axes(width=7.0, height=3.5)
    ax = axes[0, 0]
    methods = list(seconds)
    bars = ax.bar(range(len(methods)), [seconds[m] for m in methods],
                  color=[METHOD_COLORS.get(m, "tab:gray") for m in methods])
    for bar, m in zip(bars, methods, strict=True):
        bar.set_label(f"{m}: {METHOD_NOTES.get(m, '').replace(chr(10), ' ')}")
        ax.annotate(f"{seconds[m]:.3f} s", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods)
    ax.set_yscale("log")
    ax.set_ylim(top=max(seconds.values()) * 3)  # room for the labels above the bars
    ax.set_ylabel("seconds to start and join (log scale)")
    ax.set_title(f"starting {nprocs} processes that do nothing, per start method")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
