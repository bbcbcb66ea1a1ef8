"""The parent's side of the ranks' ledger feeds: each rank's collectives in the current
request, rebuilt from the lines its feed sent (wire.ledger_line), stamped with when they
arrived, and the ranks whose record has gaps (lines dropped or unreadable)."""

from __future__ import annotations

import time

from ...ledger import Call
from ..wire import ledger_line


class LedgerReader:
    """Each rank's calls since `reset()`, as (Call, monotonic arrival time), and `gaps`."""

    def __init__(self):
        self.calls: dict[int, list[tuple[Call, float]]] = {}
        self.gaps: set[int] = set()
        self._partial: dict[int, bytes] = {}

    def reset(self) -> None:
        """A new request: forget the last one's calls."""
        self.calls.clear()
        self.gaps.clear()

    def feed(self, rank: int, data: bytes) -> None:
        """Bytes read from rank's ledger feed."""
        data = self._partial.pop(rank, b"") + data
        *lines, rest = data.split(b"\n")
        if rest:
            self._partial[rank] = rest
        now = time.monotonic()
        for line in lines:
            try:
                call = Call(**ledger_line.decode(line))
            except TypeError:  # a gap (decode gave None), or fields of another version
                self.gaps.add(rank)
                continue
            self.calls.setdefault(rank, []).append((call, now))

    def last(self, rank: int) -> tuple[Call, float] | None:
        """The last collective `rank` entered in this request, and when it arrived."""
        calls = self.calls.get(rank)
        return calls[-1] if calls else None
