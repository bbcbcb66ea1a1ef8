"""Soak: 200 launches in one process, mixing successes, raising ranks and timeouts. Prints child
processes, open file descriptors and threads at the start and the end, and the warm launch
median of the first 50 and the last 50 successful launches side by side.

    python bench/soak.py [--launches 200]      (or: make soak)
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, too

import psutil  # noqa: E402

import ddp_helpers as dh  # noqa: E402
from bench import fault_fns, rank_work  # noqa: E402
from bench.common import median, timed, write_table  # noqa: E402
from ddp_helpers.engine import rank_descendants, wait_for_no_descendants  # noqa: E402


def census() -> dict[str, int]:
    """What a leak would grow: live rank processes, open fds and threads of this process."""
    wait_for_no_descendants(2.0)
    return {"rank processes alive": len(rank_descendants()),
            "open file descriptors": psutil.Process().num_fds(),
            "threads": threading.active_count()}


def one_launch(i: int) -> tuple[str, float | None]:
    """Launch number i: 8 of every 10 succeed, one raises, one times out."""
    kind = ("raise", "timeout")[(i // 10) % 2] if i % 10 == 9 else "ok"
    if kind == "ok":
        return kind, timed(lambda: dh.launch(rank_work.trivial, nprocs=2, timeout=30,
                                             output="none"), 1)[0]
    fn, timeout, err = ((fault_fns.raise_after_init, 30, dh.RankRaised) if kind == "raise"
                        else (fault_fns.sleep_forever, 1, dh.LaunchTimeout))
    try:
        dh.launch(fn, args=(2, os.devnull), nprocs=2, timeout=timeout, output="none")
    except err:
        return kind, None
    raise AssertionError(f"launch {i} ({kind}) did not fail as planned")


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit 1 if anything grew."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--launches", type=int, default=200)
    a = p.parse_args(argv)
    dh.launch(rank_work.trivial, nprocs=2, timeout=60)  # start the forkserver before counting
    first = census()
    warm = []
    kinds = {"ok": 0, "raise": 0, "timeout": 0}
    for i in range(a.launches):
        kind, seconds = one_launch(i)
        kinds[kind] += 1
        if seconds is not None:
            warm.append(seconds)
    last = census()
    rows = [[k, str(first[k]), str(last[k])] for k in first]
    head, tail = warm[:50], warm[-50:]
    rows.append(["warm launch median, first 50 vs last 50 successes",
                 f"{median(head) * 1000:.0f} ms", f"{median(tail) * 1000:.0f} ms"])
    write_table("soak", ["measure", "start", "end"], rows,
                notes=f"{a.launches} launches: {kinds['ok']} succeeded, {kinds['raise']} had a "
                      f"rank raise, {kinds['timeout']} timed out.")
    grew = [k for k in first if last[k] > first[k]]
    if grew:
        print(f"GREW: {', '.join(grew)}")
        return 1
    print("nothing grew")
    return 0


if __name__ == "__main__":
    sys.exit(main())
