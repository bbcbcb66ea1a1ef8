"""Figures drawn in the parent from the records ranks return; one module per lesson topic."""

from .common import new_axes, rank_color

__all__ = ["new_axes", "rank_color"]
