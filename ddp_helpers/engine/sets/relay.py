"""Rank output relayed into the caller, one line at a time, each prefixed with its rank.

Written from the launching thread only: ipykernel attaches output to the cell that is running
when the main thread writes, so every line lands in the launching cell, under nbval too.
"""

from __future__ import annotations

import sys

from ..wire.messages import Stream


class OutputRelay:
    """Splits the ranks' byte streams into lines; prints them live, by rank, or not at all, or
    hands each to a callable `mode(rank, stream, line)` with stream "stdout" or "stderr"."""

    def __init__(self, nprocs: int, mode="live"):
        self.mode = mode  # set per run, or per request by begin()
        self.partial = {(r, s): b"" for r in range(nprocs) for s in (Stream.OUT, Stream.ERR)}
        self.held: dict[int, list[tuple[Stream, str]]] = {r: [] for r in range(nprocs)}
        self.last: dict[int, str] = {}

    def begin(self, mode) -> None:
        """A new request: relay as `mode` says, and quote only what the ranks print from now
        on in messages (last_line)."""
        self.mode = mode
        self.last.clear()

    def feed(self, rank: int, stream: Stream, data: bytes) -> None:
        """Take bytes a rank wrote to its stdout or stderr."""
        *lines, rest = (self.partial[rank, stream] + data).split(b"\n")
        self.partial[rank, stream] = rest
        for raw in lines:
            self._line(rank, stream, raw)

    def flush(self) -> None:
        """Emit unterminated lines, then (in by_rank mode) everything held, rank 0 first."""
        for (rank, stream), rest in self.partial.items():
            if rest:
                self._line(rank, stream, rest)
                self.partial[rank, stream] = b""
        for rank, lines in self.held.items():
            for stream, text in lines:
                _emit(rank, stream, text)
            lines.clear()
        sys.stdout.flush()
        sys.stderr.flush()

    def last_line(self, rank: int) -> str:
        """The last non-blank line a rank printed (for timeout and crash messages)."""
        return self.last.get(rank, "")

    def _line(self, rank: int, stream: Stream, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if text.strip():
            self.last[rank] = text.strip()
        if callable(self.mode):
            self.mode(rank, stream.value, text)
        elif self.mode == "live":
            _emit(rank, stream, text)
        elif self.mode == "by_rank":
            self.held[rank].append((stream, text))


def _emit(rank: int, stream: Stream, text: str) -> None:
    out = sys.stdout if stream is Stream.OUT else sys.stderr
    print(f"[rank {rank}] {text}", file=out, flush=True)
