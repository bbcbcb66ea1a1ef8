"""Figures for the MNIST exercise, drawn in the parent from the records the ranks returned."""

from __future__ import annotations

import math

import numpy as np
import torch

from .common import new_axes, rank_color

_STYLES = ["-", "--", ":", "-."]  # ranks that trained on the same batches draw on top of each
# other; a dash per rank keeps every one of them visible


def _smooth(values: list[float], window: int) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    if len(v) < window:
        return v
    kernel = np.ones(window) / window
    return np.convolve(v, kernel, mode="valid")


def per_rank_loss_plot(results: list[dict], title: str | None = None, window: int = 20):
    """Training loss per step, one colour per rank: raw steps faint, a moving average on top."""
    fig, axes = new_axes(width=7.0, height=3.8)
    ax = axes[0][0]
    for r in results:
        rank, loss = r["rank"], r["loss"]
        ax.plot(range(1, len(loss) + 1), loss, color=rank_color(rank), alpha=0.25, lw=0.8)
        smooth = _smooth(loss, window)
        start = len(loss) - len(smooth) + 1
        ax.plot(range(start, start + len(smooth)), smooth, color=rank_color(rank),
                ls=_STYLES[rank % len(_STYLES)], lw=1.8,
                label=f"rank {rank}: {r['samples_seen']:,} samples, acc {r['accuracy']:.3f}")
    ax.set_xlabel("step (one batch per rank)")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title or f"Training loss per rank ({results[0].get('variant', '')})")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def time_split_plot(results: list[dict], title: str = "Where each rank's training time went"):
    """Seconds per rank spent waiting for data, computing, and in the gradient all-reduce."""
    fig, axes = new_axes(width=7.0, height=2.8)
    ax = axes[0][0]
    parts = [("data_s", "waiting for data", "tab:gray"), ("compute_s", "compute", "tab:olive"),
             ("sync_s", "gradient all-reduce", "tab:cyan")]
    for r in results:
        left = 0.0
        for key, label, color in parts:
            seconds = float(np.nansum(r[key]))
            measured = not all(math.isnan(v) for v in r[key])
            ax.barh(f"rank {r['rank']}", seconds, left=left, color=color,
                    label=label if r["rank"] == 0 and measured else None,
                    edgecolor=rank_color(r["rank"]), linewidth=2)
            left += seconds
    ax.set_xlabel("seconds (summed over steps)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def digits_grid(images: torch.Tensor, labels: torch.Tensor, per_digit: int = 8,
                title: str = "Training images"):
    """The first `per_digit` images of each digit, one row per digit."""
    fig, axes = new_axes(ncols=per_digit, nrows=10, width=0.8, height=0.8)
    for d in range(10):
        which = torch.nonzero(labels == d).flatten()[:per_digit]
        for j in range(per_digit):
            ax = axes[d][j]
            ax.axis("off")
            if j < len(which):
                img = images[which[j]].reshape(28, 28)
                ax.imshow(img.cpu().numpy(), cmap="gray")
    fig.suptitle(title)
    return fig
