"""Lesson 06's figures (and its panel's), drawn in the parent from the records ranks returned."""

from __future__ import annotations

import numpy as np

from ..lessons import gradient_sync_effects as gs
from .common import new_axes, rank_color

_STYLES = ["-", "--", ":", "-."]  # ranks whose lines coincide stay visible, one dash each
_MODE_COLORS = ["tab:red", "tab:purple", "tab:green", "tab:brown"]  # one per sync mode


def _smooth(values, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, moving average): steps start at 1 and the average is aligned to its last step."""
    v = np.asarray(values, dtype=float)
    window = max(1, min(window, len(v)))
    smooth = np.convolve(v, np.ones(window) / window, mode="valid")
    return np.arange(window, len(v) + 1), smooth


def loss_and_distance_plot(results: list[dict], title: str | None = None,
                           window: int = gs.LOSS_WINDOW):
    """Left: each rank's loss per step; right: how far the ranks' parameters are apart."""
    fig, axes = new_axes(ncols=2, width=5.2, height=3.4)
    ax_loss, ax_gap = axes[0]
    for r in results:
        steps, smooth = _smooth(r["loss"], window)
        ax_loss.plot(steps, smooth, color=rank_color(r["rank"]), ls=_STYLES[r["rank"] % 4],
                     label=f"rank {r['rank']} (acc {r['accuracy']:.3f})")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"loss on own batch ({window}-step mean)")
    ax_loss.set_title("Loss per rank")
    ax_loss.legend(loc="upper right")
    gap = gs.param_distance(results).numpy()
    if len(results) > 1:
        ax_gap.plot(np.arange(len(gap)), gap, color=rank_color(1),
                    label="largest ||params(rank r) - params(rank 0)||")
        ax_gap.set_ylim(0, max(1.15 * float(gap.max()), 0.01))
        if gap.max() == 0:
            ax_gap.text(0.5, 0.5, "exactly 0 at every step", ha="center", va="bottom",
                        transform=ax_gap.transAxes, color=rank_color(1))
        ax_gap.legend(loc="upper left")
    else:
        ax_gap.text(0.5, 0.5, "one rank: nothing to compare", ha="center", va="center",
                    transform=ax_gap.transAxes)
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("L2 distance")
    ax_gap.set_title("Distance between the ranks' parameters")
    first = results[0]
    sync = {"ddp": "sync on (DDP)", "none": "sync off",
            "average": f"average every {first['every']}"}
    split = "IID shards" if first["split"] == "iid" else "split by label"
    fig.suptitle(title or f"{first['world_size']} rank(s), {sync[first['sync']]}, {split}, "
                 f"lr {first['lr']:g}, batch {first['batch_size']} per rank")
    fig.tight_layout()
    return fig


def sync_modes_plot(runs: dict[str, list[dict]], window: int = gs.LOSS_WINDOW, title: str = ""):
    """For each way of syncing: the ranks' parameter distance (left) and mean loss (right)."""
    fig, axes = new_axes(ncols=2, width=5.2, height=3.4)
    ax_gap, ax_loss = axes[0]
    for i, (label, results) in enumerate(runs.items()):
        color = _MODE_COLORS[i % len(_MODE_COLORS)]
        gap = gs.param_distance(results).numpy()
        ax_gap.plot(np.arange(len(gap)), gap, color=color, ls=_STYLES[i % 4], label=label)
        steps, smooth = _smooth(gs.mean_loss(results), window)
        acc = np.mean([r["accuracy"] for r in results])
        ax_loss.plot(steps, smooth, color=color, ls=_STYLES[i % 4],
                     label=f"{label} (mean acc {acc:.3f})")
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("L2 distance, rank 1 to rank 0")
    ax_gap.set_title("How far the ranks drift apart")
    ax_gap.legend(loc="upper left")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"loss, mean of the ranks ({window}-step mean)")
    ax_loss.set_title("Training loss")
    ax_loss.legend(loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def lr_scaling_plot(runs: list[tuple[int, str, list[dict]]], window: int = gs.LOSS_WINDOW):
    """Mean loss against samples processed by all ranks together, per world size and lr rule."""
    fig, axes = new_axes(width=7.0, height=3.8)
    ax = axes[0][0]
    for n, rule, results in runs:
        loss = gs.mean_loss(results)
        steps, smooth = _smooth(loss, max(1, window // n))
        seen = steps * results[0]["batch_size"] * n
        ax.plot(seen, smooth, color=rank_color(n - 1), ls="-" if rule == "scaled" else "--",
                label=f"{n} rank(s), lr {results[0]['lr']:g} ({rule}), "
                      f"acc {results[0]['accuracy']:.3f}")
    ax.set_xlabel("samples processed, all ranks together")
    ax.set_ylabel("loss (mean of the ranks, smoothed)")
    ax.set_title("Same data, more ranks: keep the rate, or scale it with the batch")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig


def allreduce_cost_plot(measured: list[list[dict]], fitted_on: int):
    """Measured all-reduce seconds against bytes per world size, with the ring model
    t = 2(N-1) alpha + 2(N-1)/N * S / B fitted on the points of world size `fitted_on` only
    (`fit_ring_on`): the title says so, since the other sizes' curves are predictions."""
    alpha, bandwidth = gs.fit_ring_on(gs.cost_points(measured), fitted_on)
    fig, axes = new_axes(width=7.0, height=3.8)
    ax = axes[0][0]
    for n, nbytes, seconds in gs.cost_points(measured):
        ax.plot(nbytes, seconds * 1e3, "o", color=rank_color(n - 1))
    for results in measured:
        n = results[0]["world_size"]
        sizes = 4.0 * np.array(results[0]["numels"])
        grid = np.geomspace(sizes.min(), sizes.max(), 50)
        model = [gs.ring_seconds(b, n, alpha, bandwidth) * 1e3 for b in grid]
        ax.plot(grid, model, "-", color=rank_color(n - 1), alpha=0.7,
                label=f"{n} ranks: measured (dots), model {gs.latency_steps(n)} alpha + "
                      f"{gs.ring_factor(n):.2g} S/B")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes all-reduced, S (float32)")
    ax.set_ylabel("milliseconds per all-reduce")
    ax.set_title(f"Ring all-reduce cost (fit on {fitted_on} ranks: alpha {alpha * 1e6:.0f} us, "
                 f"B {bandwidth / 1e9:.2g} GB/s; the others predicted)")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    return fig
