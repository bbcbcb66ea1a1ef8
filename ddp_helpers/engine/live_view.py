"""A live view of the ranks while a cell runs long: after LIVE_AFTER seconds without every
rank's answer, one plain-text line per rank under the cell, updated in place (a display with a
display id), saying where each rank is: the cell line, the torch call, the collective it
entered, and for how long. Fast cells show nothing; when the cell ends the view is emptied,
and the result or the kit's error message follows as usual.

Shown only where a person watches: in a Jupyter kernel whose frontend lets the cell ask for
input (JupyterLab, Notebook, VS Code). Batch runs (nbconvert, nbclient, nbval) send their cells
with stdin off, so an executed notebook never holds a view whose presence would depend on how
fast the machine was. DDP_HELPERS_LIVE_VIEW=1 forces the view on (tests), =0 off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from .wire.messages import Where

LIVE_AFTER = 2.0  # seconds before the view appears: most cells have answered by then
REFRESH = 1.0  # seconds between updates; each asks every unfinished rank where it is


def display_factory() -> Callable[[str], Callable[[str], None]] | None:
    """A function that shows a text and returns its updater, where a person watches the cell;
    None elsewhere (plain Python, a terminal IPython, a batch run)."""
    forced = os.environ.get("DDP_HELPERS_LIVE_VIEW")
    if forced == "0":
        return None
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or (forced != "1" and not getattr(kernel, "_allow_stdin", False)):
        return None
    from IPython.display import display

    def show(text: str) -> Callable[[str], None]:
        handle = display({"text/plain": text}, raw=True, display_id=True)
        return lambda new: handle.update({"text/plain": new}, raw=True)

    return show


class LiveView:
    """The view of one request: call tick() as the wait loop turns, close() when it ends."""

    def __init__(self, watch, labels, show: Callable[[str], Callable[[str], None]] | None):
        self.watch, self.labels, self.show = watch, labels, show
        self._update: Callable[[str], None] | None = None
        self._next = watch.started + LIVE_AFTER
        self._since: dict[int, tuple[str, float]] = {}  # rank -> (where, since when)

    def tick(self) -> None:
        """Show or refresh the view if it is time to."""
        now = time.monotonic()
        if self.show is None or now < self._next:
            return
        self._next = now + REFRESH
        text = self.text(now)
        if self._update is None:
            self._update = self.show(text)
        else:
            self._update(text)

    def close(self) -> None:
        """Empty the view (the cell's result or error says the rest)."""
        if self._update is not None:
            self._update("")
            self._update = None

    def text(self, now: float) -> str:
        """One line per rank asked: where it is and for how long."""
        ranks, watch = self.watch.ranks, self.watch
        replied = ranks.replies()
        head = f"ddp_helpers: the cell has run {now - watch.started:.0f} s"
        lines = [head]
        for rank in watch.targets:
            if rank in replied:
                lines.append(f"  rank {rank}: finished the cell")
            elif not ranks.alive(rank):
                lines.append(f"  rank {rank}: exited")
            else:
                lines.append(f"  rank {rank}: {self._where(rank, ranks.where(rank), now)}")
        return "\n".join(lines)

    def _where(self, rank: int, info: Where | None, now: float) -> str:
        entered, at = self._last_call(rank)
        if info is None:
            here = f"in C++ code (no answer), {entered}"
        elif info.idle:
            here, at = "between cells", None
        else:
            call = f", in {info.call}" if info.call else ""
            here = f"{self.labels.where(info)}{call}" + (f", {entered}" if info.in_comm else "")
            at = at if info.in_comm else None
        seen, since = self._since.get(rank, (None, now))
        if seen != here:
            since = now
        self._since[rank] = (here, since)
        if at is None and since == now:
            return here  # just seen here: how long it has been there is not known yet
        # In a collective, the ledger line's arrival says when the rank entered it.
        return f"{here} for {now - (at or since):.0f} s"

    def _last_call(self, rank: int) -> tuple[str, float | None]:
        """The last collective the rank entered in this cell (from its ledger feed) and when."""
        last = self.watch.ranks.ledger.last(rank)
        if last is None:
            return "no collective entered yet", None
        call, arrived = last
        return f"entered {call.text()}", arrived
