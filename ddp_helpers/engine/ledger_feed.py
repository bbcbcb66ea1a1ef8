"""Each rank's ledger, fed to the parent as it goes: one short line per collective the rank
enters, written before the op runs, so the parent knows where a stuck rank sits (and where a
rank that gloo aborted was) without asking it.

Rank side: `feed()` is the Ledger's on_call. The pipe is non-blocking: a rank never waits for
the parent; a record that does not fit is dropped and counted, and the next record says how
many were lost, so the parent stops comparing that rank instead of comparing a wrong count.
Parent side: `LedgerReader` turns the bytes back into Calls, stamped with when they arrived.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable

from ..ledger import Call

_PIPE_BUF = 4096  # a pipe write up to this size is all or nothing, even non-blocking
_PIPE_SIZE = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size


def encode(call: Call) -> bytes:
    """A call as one JSON line (what LedgerReader.feed reads)."""
    return json.dumps([call.seq, call.op, call.group, call.shapes, call.dtypes, call.nbytes,
                       call.where[0], call.where[1], call.peer, call.root]).encode() + b"\n"


class Feed:
    """on_call for a rank's Ledger: one JSON line per call into the parent's pipe."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        # The parent reads this pipe once per poll (a quarter second at most): room for about
        # ten thousand lines in between, where Linux allows (its default is 64 KiB).
        with contextlib.suppress(AttributeError, OSError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        self.fd = fd
        self.dropped = 0

    def __call__(self, call: Call) -> None:
        line = encode(call)
        if self.dropped:
            line = json.dumps(["dropped", self.dropped]).encode() + b"\n" + line
        try:
            os.write(self.fd, line[-_PIPE_BUF:])
            self.dropped = 0
        except OSError:  # full (the parent is behind) or gone: never block the rank
            self.dropped += 1


_feed: Callable[[Call], None] | None = None


def feed_with(on_call: Callable[[Call], None]) -> None:
    """Make on_call this rank's feed: a served rank (served_rank.py) has no ledger pipe, and
    sends each line over its connection itself."""
    global _feed
    _feed = on_call


def feed() -> Callable[[Call], None] | None:
    """This rank's feed (None outside a rank the kit started with a ledger pipe, or that
    called feed_with)."""
    global _feed
    if _feed is None:
        from .rank_entry import _current

        if _current is not None and _current.ledger is not None:
            _feed = Feed(_current.ledger.fileno())
    return _feed


class LedgerReader:
    """Parent side: each rank's calls since `reset()`, as (Call, monotonic arrival time), and
    the ranks whose record has gaps."""

    def __init__(self):
        self.calls: dict[int, list[tuple[Call, float]]] = {}
        self.gaps: set[int] = set()
        self._partial: dict[int, bytes] = {}

    def reset(self) -> None:
        """A new request: forget the last one's calls."""
        self.calls.clear()
        self.gaps.clear()

    def feed(self, rank: int, data: bytes) -> None:
        """Bytes read from rank's ledger pipe."""
        data = self._partial.pop(rank, b"") + data
        *lines, rest = data.split(b"\n")
        if rest:
            self._partial[rank] = rest
        now = time.monotonic()
        for line in lines:
            try:
                item = json.loads(line)
            except ValueError:
                self.gaps.add(rank)
                continue
            if item and item[0] == "dropped":
                self.gaps.add(rank)
                continue
            seq, op, group, shapes, dtypes, nbytes, path, lineno, peer, root = item
            call = Call(seq, op, group, tuple(tuple(s) for s in shapes), tuple(dtypes), nbytes,
                        (path, lineno), peer, root)
            self.calls.setdefault(rank, []).append((call, now))
