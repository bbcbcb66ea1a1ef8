"""Training throughput with 1, 2, ... ranks, side by side in one run, for the seed's model and a
small CNN, with speed-up and scaling efficiency; plus the seed's model at larger batches (where
DDP starts to pay off) and one process using every core through threads (the honest baseline).
One core per rank on CPUs; one GPU per rank with NCCL where there are enough GPUs.

    python -m bench.scaling [--max-ranks 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import matplotlib

matplotlib.use("Agg")  # files only, also on a machine without a display

import ddp_helpers as dh
from bench.common import RESULTS, write_table
from ddp_helpers.lessons import performance_and_debugging as perf
from ddp_helpers.plots import performance_and_debugging as perf_plots

STEPS = {"linear": 200, "cnn": 40}  # about a second of work per run on one core


def rank_counts(max_ranks: int | None) -> list[int]:
    """1, 2, ... up to the GPUs (if two or more) or the cores (at least 2), capped by max_ranks."""
    gpus = dh.gpu_count()
    most = gpus if gpus >= 2 else max(2, os.cpu_count() or 1)
    return list(range(1, min(most, max_ranks or most) + 1))


def measure(model: str, nprocs: int, batch: int, repeats: int, threads: int | None = 1) -> float:
    """Median samples/s of the whole job over `repeats` launches."""
    steps = max(10, STEPS[model] * 64 // batch)
    runs = [perf.throughput(dh.launch(perf.train_throughput,
                                      args=(nprocs, model, steps, batch, 3, threads),
                                      nprocs=nprocs, timeout=600, output="none"))
            for _ in range(repeats)]
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> dict:
    """Measure, print and write the table and the plot; return samples/s by (model, batch)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max-ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="launches per point (median kept)")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024],
                   help="per-rank batches for the seed model")
    a = p.parse_args(argv)
    ns = rank_counts(a.max_ranks)
    cases = [("cnn", 64)] + [("linear", b) for b in a.batches]
    results: dict[tuple[str, int], dict[int, float]] = {}
    rows = []
    for model, batch in cases:
        by_n = {n: measure(model, n, batch, a.repeats) for n in ns}
        results[model, batch] = by_n
        for n in ns:
            rows.append([model, str(batch), str(n), f"{by_n[n]:,.0f}",
                         f"{by_n[n] / by_n[1]:.2f}x",
                         f"{perf.scaling_efficiency(by_n[n], by_n[1], n):.2f}"])
    on_gpu = dh.gpu_count() >= 2
    versus = []
    if not on_gpu:  # the baseline a CPU user really has: one process, every core as threads
        for model, batch in cases:
            whole = measure(model, 1, batch, a.repeats, threads=None)
            by_n = results[model, batch]
            rows.append([model, str(batch), f"1 ({os.cpu_count()} threads)", f"{whole:,.0f}",
                         f"{whole / by_n[1]:.2f}x", "-"])
            versus.append(f"{model} batch {batch}: {by_n[ns[-1]] / whole:.2f}x")
    notes = ("Weak scaling: each rank keeps its batch. efficiency = throughput(N) / "
             "(N x throughput(1 rank)). ")
    if on_gpu:
        notes += "One GPU per rank (NCCL)."
    else:
        notes += ("One core (one intra-op thread) per rank, so N ranks use N cores. The rows "
                  f"'1 ({os.cpu_count()} threads)' run one process with every core as threads "
                  f"instead; {ns[-1]} ranks (one core each) against that process: "
                  + "; ".join(versus) + ".")
    write_table("scaling", ["model", "batch per rank", "ranks", "samples/s (median)",
                            "speed-up vs 1 rank", "efficiency"], rows, notes=notes)
    fig = perf_plots.scaling_plot({f"{m}, batch {b}": by_n for (m, b), by_n in results.items()})
    fig.savefig(RESULTS / "scaling.png", dpi=100)
    print(f"plot: {RESULTS / 'scaling.png'}")
    return results


if __name__ == "__main__":
    main()
