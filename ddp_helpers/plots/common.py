"""What every figure shares: one colour per rank, fixed sizes, labelled axes."""

from __future__ import annotations

import matplotlib.pyplot as plt

_RANK_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                "tab:pink", "tab:gray"]


def rank_color(rank: int) -> str:
    """The colour rank r has in every figure of the kit."""
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def new_axes(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 3.5,
             **kwargs):
    """A figure of a fixed size with a grid of axes (fixed sizes keep nbval's text stable)."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows),
                             squeeze=False, **kwargs)
    return fig, axes
