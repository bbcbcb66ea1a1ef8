"""What the second world size costs an exercise check: each "ranks" exercise's kit solution
typed on 2 ranks, then checked on those ranks only (the check's first half) and in full (the
second pool of 3 ranks started, the answer's cells run again, the check run there, the pool
stopped), in the same run.

    python -m bench.exercise_checks [--repeats N]

Medians of `repeats` checks each, with min and max; the ratio is full / first half.
"""

from __future__ import annotations

import argparse
import time

import ddp_helpers as dh
from bench.common import median, write_table
from ddp_helpers import exercises


def _spread(xs: list[float]) -> str:
    return f"{median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def time_check(pool: dh.Ranks, name: str, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of the check on the learner's 2 ranks only, and of the whole check."""
    ex = exercises.find(name)
    pool.run(exercises.solution_source(name))
    first, whole = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert all(c.ok for c in exercises._run_on_ranks(ex, pool)), name
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        line = exercises.evaluate(name, pool=pool).line
        whole.append(time.perf_counter() - t0)
        assert line.startswith(f"PASS {name}:") and "world sizes 2 and 3" in line, line
    return first, whole


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    names = sorted(n for n, ex in exercises.all_exercises().items() if ex.kind == "ranks")
    rows = []
    with dh.Ranks(2, output="none", env={"WORKDIR": "/tmp"}) as pool:
        for name in names:
            first, whole = time_check(pool, name, args.repeats)
            rows.append([name, _spread(first), _spread(whole),
                         f"{median(whole) / median(first):.1f}x"])
    write_table("exercise_checks", ["exercise", "on the 2 ranks only", "whole check (2, then 3)",
                                    "whole / first"], rows,
                notes=f"Medians of {args.repeats} checks each (min-max). The whole check starts "
                      "and stops a pool of 3 ranks each time.")


if __name__ == "__main__":
    main()
