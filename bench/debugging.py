"""What looking inside the ranks costs: the time to open pdb post-mortem on a rank (and leave
it), what the snapshot of every rank's stack adds to a stop, and `%ranks where` at 2, 4 and 8
ranks, each beside the round trip of a trivial cell in the same run.

    python -m bench.debugging [--repeats N]

Post-mortem: `pool.debug(1, commands=["p loss", "q"])` after a cell that raised on rank 1,
from the call to its return (pdb opened on the failing frame, one expression printed, left).
Stop: a cell whose collective only rank 0 calls, from sending it to its CollectiveMismatch
(the kit names it, snapshots every rank, stops them), with the snapshot and with it switched
off (the pool's `_snapshot` replaced by one that asks nothing), the next group's start not
counted. Medians of `repeats` runs, with min and max.
"""

from __future__ import annotations

import argparse
import time

import ddp_helpers as dh
from bench.common import median, write_table

FAIL = "loss = torch.tensor(float('nan')) * rank\nif rank == 1:\n    raise ValueError('nan')"
STUCK = "if rank == 0:\n    dist.barrier()"


def _spread(xs: list[float]) -> str:
    return f"{median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def post_mortem(pool: dh.Ranks, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per post-mortem session, and per trivial cell, on the same pool."""
    sessions, cells = [], []
    for _ in range(repeats):
        try:
            pool.run(FAIL, output="none")
        except dh.RankRaised:
            pass
        t0 = time.perf_counter()
        pool.debug(1, commands=["p loss", "q"])
        sessions.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pool.run("1")
        cells.append(time.perf_counter() - t0)
    return sessions, cells


def stop(pool: dh.Ranks, repeats: int, snapshot: bool) -> list[float]:
    """Seconds from a stuck cell to its CollectiveMismatch (snapshot on or off)."""
    taken = dh.Ranks._snapshot
    if not snapshot:
        dh.Ranks._snapshot = lambda self: {}
    try:
        out = []
        for _ in range(repeats):
            pool.run("1")  # fresh ranks up before the clock starts
            t0 = time.perf_counter()
            try:
                pool.run(STUCK, output="none")
            except dh.CollectiveMismatch:
                out.append(time.perf_counter() - t0)
        return out
    finally:
        dh.Ranks._snapshot = taken


def where(pool: dh.Ranks, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        str(pool.where())
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = []
    for n in (2, 4, 8):
        with dh.Ranks(n, backend="gloo", output="none", timeout=120) as pool:
            sessions, cells = post_mortem(pool, args.repeats)
            places = where(pool, args.repeats)
            on = stop(pool, args.repeats, snapshot=True)
            off = stop(pool, args.repeats, snapshot=False)
        rows.append([str(n), _spread(sessions), _spread(cells), _spread(on), _spread(off),
                     f"{(median(on) - median(off)) * 1e3:+.0f} ms", _spread(places)])
        print(rows[-1], flush=True)
    write_table("debugging", ["ranks", "post-mortem (open, p, q)", "trivial cell",
                              "stop with snapshot", "stop without", "snapshot adds",
                              "%ranks where"], rows,
                notes="Medians (min-max) of " + str(args.repeats) + " runs each, on this "
                "machine's shared cores. A stop includes the settle and stall rules' waiting "
                "(about 0.5 s) before the mismatch is named; the snapshot is the difference.")


if __name__ == "__main__":
    main()
