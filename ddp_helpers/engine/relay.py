"""Rank output relayed into the caller, one line at a time, each prefixed with its rank.

Written from the launching thread only: ipykernel attaches output to the cell that is running
when the main thread writes, so every line lands in the launching cell, under nbval too.
"""

from __future__ import annotations

import sys


class OutputRelay:
    """Splits the ranks' byte streams into lines; prints them live, by rank, or not at all, or
    hands each to a callable `mode(rank, stream, line)` with stream "stdout" or "stderr"."""

    def __init__(self, nprocs: int, mode="live"):
        self.mode = mode  # set per run or per request by RankSet.relay_to
        self.partial = {(r, k): b"" for r in range(nprocs) for k in ("out", "err")}
        self.held: dict[int, list[tuple[str, str]]] = {r: [] for r in range(nprocs)}
        self.last: dict[int, str] = {}

    def feed(self, rank: int, kind: str, data: bytes) -> None:
        """Take bytes a rank wrote to stdout ("out") or stderr ("err")."""
        *lines, rest = (self.partial[rank, kind] + data).split(b"\n")
        self.partial[rank, kind] = rest
        for raw in lines:
            self._line(rank, kind, raw)

    def flush(self) -> None:
        """Emit unterminated lines, then (in by_rank mode) everything held, rank 0 first."""
        for (rank, kind), rest in self.partial.items():
            if rest:
                self._line(rank, kind, rest)
                self.partial[rank, kind] = b""
        for rank, lines in self.held.items():
            for kind, text in lines:
                _emit(rank, kind, text)
            lines.clear()
        sys.stdout.flush()
        sys.stderr.flush()

    def last_line(self, rank: int) -> str:
        """The last non-blank line a rank printed (for timeout and crash messages)."""
        return self.last.get(rank, "")

    def _line(self, rank: int, kind: str, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if text.strip():
            self.last[rank] = text.strip()
        if callable(self.mode):
            self.mode(rank, "stdout" if kind == "out" else "stderr", text)
        elif self.mode == "live":
            _emit(rank, kind, text)
        elif self.mode == "by_rank":
            self.held[rank].append((kind, text))


def _emit(rank: int, kind: str, text: str) -> None:
    stream = sys.stdout if kind == "out" else sys.stderr
    print(f"[rank {rank}] {text}", file=stream, flush=True)
