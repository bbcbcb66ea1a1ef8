"""Lesson 05's figures (and the MNIST command's plot), drawn in the parent from rank records."""

from __future__ import annotations

import math

import numpy as np

from .common import new_axes, rank_color

_STYLES = ["-", "--", ":", "-."]  # ranks that trained on the same batches draw on top of each
# other; a dash per rank keeps every one of them visible
_PARTS = [("data_s", "waiting for data", "tab:gray"), ("compute_s", "compute", "tab:olive"),
          ("sync_s", "gradient all-reduce", "tab:cyan")]


def _smooth(values: list[float], window: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, moving average): steps start at 1 and the average is aligned to its last step."""
    v = np.asarray(values, dtype=float)
    window = max(1, min(window, len(v)))
    return np.arange(window, len(v) + 1), np.convolve(v, np.ones(window) / window, mode="valid")


def _loss_axes(ax, results: list[dict], window: int, title: str) -> None:
    for r in results:
        rank, loss = r["rank"], r["loss"]
        ax.plot(range(1, len(loss) + 1), loss, color=rank_color(rank), alpha=0.25, lw=0.8)
        steps, smooth = _smooth(loss, window)
        ax.plot(steps, smooth, color=rank_color(rank), ls=_STYLES[rank % len(_STYLES)], lw=1.8,
                label=f"rank {rank}: {r['samples_seen']:,} samples, acc {r['accuracy']:.3f}")
    ax.set_xlabel("step (one batch per rank)")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")


def per_rank_loss_plot(results: list[dict], title: str = "Training loss per rank",
                       window: int = 20):
    """Training loss per step, one colour per rank: raw steps faint, a moving average on top."""
    fig, axes = new_axes(width=7.0, height=3.8)
    _loss_axes(axes[0][0], results, window, title)
    fig.tight_layout()
    return fig


def listing_loss_plot(faithful: list[dict], fixed: list[dict], window: int = 5):
    """The listing as printed beside the fixed one: each rank's loss per step."""
    fig, axes = new_axes(ncols=2, width=5.2, height=3.4, sharey=True)
    _loss_axes(axes[0][0], faithful, window, "As printed: no sampler")
    _loss_axes(axes[0][1], fixed, window, "Fixed: DistributedSampler")
    fig.tight_layout()
    return fig


def epoch_time_plot(runs: dict[str, list[dict]],
                    title: str = "Where each rank's epoch went"):
    """One stacked bar per (run, rank): waiting for data, compute and gradient all-reduce."""
    fig, axes = new_axes(width=7.5, height=1.0 + 0.55 * sum(len(r) for r in runs.values()))
    ax = axes[0][0]
    labelled = set()
    for name, results in runs.items():
        for r in results:
            left = 0.0
            for key, label, color in _PARTS:
                measured = [v for v in r[key] if not math.isnan(v)]
                show = bool(measured) and label not in labelled
                labelled |= {label} if show else set()
                ax.barh(f"{name}: rank {r['rank']}", sum(measured), left=left, color=color,
                        label=label if show else None, edgecolor=rank_color(r["rank"]),
                        linewidth=2)
                left += sum(measured)
    ax.invert_yaxis()  # the first run on top
    ax.set_xlabel("seconds in the epoch (summed over steps); bar edge: rank colour")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return fig


def samples_and_time_plot(results: list[dict], title: str = ""):
    """The panel's picture: per rank, the samples it trained on and its epoch's seconds."""
    fig, axes = new_axes(ncols=2, width=4.6, height=3.0)
    ax_n, ax_t = axes[0]
    ranks = [r["rank"] for r in results]
    colors = [rank_color(r) for r in ranks]
    names = [f"rank {r}" for r in ranks]
    ax_n.bar(names, [r["samples_seen"] for r in results], color=colors)
    ax_n.axhline(results[0].get("dataset", 0) or 0, color="gray", ls="--", lw=1,
                 label="images in the run")
    ax_n.set_ylabel("samples trained on")
    ax_n.set_title("Samples seen per rank")
    ax_n.legend(loc="lower right", fontsize="small")
    ax_t.bar(names, [sum(r["epoch_s"]) for r in results], color=colors)
    ax_t.set_ylabel("seconds")
    ax_t.set_title("Epoch time per rank")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
