"""`%%ranks --ledger`: a cell's collectives side by side, one column per rank, one row per call
in the order each rank made them, so that a barrier, a mismatch or DDP's buckets can be read
off (row 3: rank 0 in barrier, rank 1 in all_reduce). The calls come from the ledger feed the
engine keeps for every cell (sets.ledger_reader); nothing extra runs on the ranks."""

from __future__ import annotations

from collections.abc import Callable

from ...ledger import Call


def ledger_table(calls: dict[int, list[Call]], ranks: list[int], title: str,
                 place: Callable[[tuple[str, int]], str]) -> str:
    """The table of `calls` ({rank: [Call, ...]}) for `ranks`, with a totals line per rank."""
    if not any(calls.get(r) for r in ranks):
        return f"{title}: no collective or send/recv was called."
    cells = {r: [f"{c.text()} ({_where(c, place)})" for c in calls.get(r, [])]
             for r in ranks}
    width = max(len(t) for col in cells.values() for t in col) + 2
    rows = max(len(col) for col in cells.values())
    out = [f"{title}, each rank's calls in the order it made them:",
           "     " + "".join(f"rank {r}".ljust(width) for r in ranks).rstrip()]
    for i in range(rows):
        row = "".join((cells[r][i] if i < len(cells[r]) else "-").ljust(width) for r in ranks)
        out.append(f"{i + 1:>3}  {row.rstrip()}")
    out.append("  " + "; ".join(f"rank {r}: {_total(calls.get(r, []))}" for r in ranks))
    return "\n".join(out)


def _where(call: Call, place: Callable[[tuple[str, int]], str]) -> str:
    """"line 4" for a line of the cell (the title names it), else the file's place."""
    path, line = call.where
    return f"line {line}" if path.startswith("<cell ") else place(call.where)


def _total(calls: list[Call]) -> str:
    return f"{len(calls)} calls, {sum(c.nbytes for c in calls):,} B"
