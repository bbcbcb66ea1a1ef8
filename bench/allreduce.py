"""All-reduce bandwidth, side by side in one run: algorithm and bus bandwidth for a sweep of
message sizes, against this machine's own memory-copy bandwidth measured in the same launch.
gloo on CPUs; NCCL with CUDA-event timing where there is one GPU per rank.

    python -m bench.allreduce [--nprocs 2] [--max-mib 64] [--iters 5] [--trials 5]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")  # files only, also on a machine without a display

import ddp_helpers as dh
from bench.common import RESULTS, write_table
from ddp_helpers.lessons import performance as perf
from ddp_helpers.plots import performance as perf_plots


def sizes_up_to(max_mib: int) -> list[int]:
    """4 KiB, 16 KiB, ... up to max_mib MiB: latency-bound first, bandwidth-bound last."""
    sizes, s = [], 4 << 10
    while s <= max_mib << 20:
        sizes.append(s)
        s *= 4
    return sizes


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep, print and write the table and the plot; return the bandwidth record."""
    p = argparse.ArgumentParser(description=__doc__)
    gpus = dh.gpu_count()
    p.add_argument("--nprocs", type=int, default=gpus if gpus >= 2 else 2)
    p.add_argument("--max-mib", type=int, default=64, help="largest message, in MiB")
    p.add_argument("--iters", type=int, default=5, help="back-to-back all-reduces per trial")
    p.add_argument("--trials", type=int, default=5, help="trials per size (the median is kept)")
    a = p.parse_args(argv)
    sizes = sizes_up_to(a.max_mib)
    records = dh.launch(perf.allreduce_sweep, args=(a.nprocs, sizes, a.iters, a.trials),
                        nprocs=a.nprocs, timeout=600, output="none")
    bw = perf.bandwidths(records)
    rows = [[_human(s), f"{t * 1e6:,.0f} us", f"{alg:.3f}", f"{bus:.3f}",
             f"{bus / bw['copy_gbps']:.1%}"]
            for s, t, alg, bus in zip(sizes, bw["seconds"], bw["algbw"], bw["busbw"])]
    timing = "CUDA events" if bw["device"] == "cuda" else "time.perf_counter"
    write_table("allreduce", ["message", "median time (slowest rank)", "algbw GB/s",
                              "busbw GB/s", "busbw / memory copy"], rows,
                notes=(f"{bw['world_size']} ranks, {bw['backend']} on {bw['device']}, timed with "
                       f"{timing}; busbw = algbw x 2(N-1)/N = algbw x "
                       f"{perf.bus_factor(bw['world_size']):g}. Memory copy of "
                       f"{_human(records[0]['copy_bytes'])} on rank 0 in the same run: "
                       f"{bw['copy_gbps']:.2f} GB/s. Best busbw: {max(bw['busbw']):.3f} GB/s, "
                       f"{max(bw['busbw']) / bw['copy_gbps']:.1%} of the memory copy."))
    fig = perf_plots.bandwidth_plot(bw)
    fig.savefig(RESULTS / "allreduce.png", dpi=100)
    print(f"plot: {RESULTS / 'allreduce.png'}")
    return bw


if __name__ == "__main__":
    main()
