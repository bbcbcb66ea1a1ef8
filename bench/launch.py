"""Launch overhead, side by side in one run: dh.launch warm (forkserver), dh.launch with spawn,
and torch.multiprocessing.spawn, for the same trivial two-rank function.

    python -m bench.launch [--repeats 20] [--slow-repeats 5]
"""

from __future__ import annotations

import argparse

import torch.multiprocessing as mp

import ddp_helpers as dh
from bench import rank_work
from bench.common import median, timed, write_table


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print medians and ratios; return the medians by row name."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=20, help="timed warm launches")
    p.add_argument("--slow-repeats", type=int, default=5, help="timed spawn launches")
    a = p.parse_args(argv)
    rows = {
        "dh.launch (warm forkserver)": timed(
            lambda: dh.launch(rank_work.trivial, nprocs=2, timeout=60), a.repeats, warmup=1),
        "dh.launch + gloo group + all_reduce": timed(
            lambda: dh.launch(rank_work.gloo_all_reduce, args=(2,), nprocs=2, timeout=60),
            a.repeats, warmup=1),
        "dh.launch(start_method='spawn')": timed(
            lambda: dh.launch(rank_work.trivial, nprocs=2, timeout=120, start_method="spawn"),
            a.slow_repeats),
        "torch.multiprocessing.spawn": timed(
            lambda: mp.spawn(rank_work.trivial, nprocs=2), a.slow_repeats),
    }
    medians = {k: median(v) for k, v in rows.items()}
    spawn = medians["torch.multiprocessing.spawn"]
    table = [[name, f"{len(rows[name])}", f"{m * 1000:.0f} ms", f"{spawn / m:.1f}x"]
             for name, m in medians.items()]
    write_table("launch", ["launcher, trivial two-rank function", "runs", "median",
                           "faster than mp.spawn"], table,
                notes="Target: warm dh.launch at most 0.1 s median and at least 30x faster "
                      "than torch.multiprocessing.spawn in the same run.")
    return medians


if __name__ == "__main__":
    main()
