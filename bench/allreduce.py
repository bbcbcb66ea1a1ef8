"""All-reduce bandwidth, side by side in one run: algorithm and bus bandwidth for a sweep of
message sizes, against a reference copy measured on the same machine in the same run.

- CPUs (gloo): the reference is main memory's copy bandwidth, timed on rank 0 during the launch.
- Two GPUs or more (NCCL): the reference is the link, a cuda:0 -> cuda:1 copy (peer to peer
  when peer access is on, staged through the host when it is off; the table says which). The
  sweep goes to 256 MiB, where NCCL reaches its bus bandwidth.
- One GPU: NCCL needs two ranks with a GPU each, so the sweep runs with gloo on the CPU and the
  table says that the link reference needs two GPUs.
Every time comes from ddp_helpers.timing: CUDA events on GPUs, time.perf_counter on CPUs.

    python -m bench.allreduce [--nprocs 2] [--max-mib 64|256] [--iters 5] [--trials 5]
                              [--name allreduce] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, also on a machine without a display

import ddp_helpers as dh
from bench.common import RESULTS, write_table
from ddp_helpers import timing
from ddp_helpers.lessons import performance_and_debugging as perf
from ddp_helpers.plots import performance_and_debugging as perf_plots


def sizes_up_to(max_mib: int) -> list[int]:
    """4 KiB, 16 KiB, ... up to max_mib MiB: latency-bound first, bandwidth-bound last."""
    sizes, s = [], 4 << 10
    while s <= max_mib << 20:
        sizes.append(s)
        s *= 4
    return sizes


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def link_reference(nbytes: int, iters: int, trials: int) -> dict:
    """The cuda:0 -> cuda:1 copy of nbytes, in this (parent) process, after the ranks are gone."""
    peer = timing.peer_access(0, 1)
    seconds = timing.copy_seconds(nbytes, "cuda:0", "cuda:1", iters=iters, trials=trials)
    return {"name": f"cuda:0 -> cuda:1 copy (peer access {'on' if peer else 'off'})",
            "gbps": nbytes / seconds / 1e9, "bytes": nbytes, "peer_access": peer}


def reference(bw: dict, records: list[dict], gpus: int, a: argparse.Namespace) -> dict:
    """What busbw is compared against, and a sentence on why that one."""
    copy = {"name": f"memory copy of {_human(records[0]['copy_bytes'])} on rank 0 "
                    f"({bw['device']})", "gbps": bw["copy_gbps"]}
    if bw["device"] == "cuda" and gpus >= 2:
        link = link_reference(max(bw["sizes_bytes"]), a.iters, a.trials)
        link["note"] = (f"On-device {copy['name']}: {copy['gbps']:.1f} GB/s (the GPU's own "
                        "memory, not a link, so not the ceiling).")
        return link
    if gpus == 1:
        copy["note"] = ("One GPU: NCCL needs a GPU per rank, so this ran gloo on the CPU; the "
                        "link reference (a cuda:0 -> cuda:1 copy) needs two GPUs.")
    return copy


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep, print and write the table and the plot; return the bandwidth record."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpus = dh.gpu_count()
    p.add_argument("--nprocs", type=int, default=gpus if gpus >= 2 else 2)
    p.add_argument("--max-mib", type=int, default=None,
                   help="largest message in MiB (default: 256 with NCCL, 64 on CPUs)")
    p.add_argument("--iters", type=int, default=5, help="back-to-back all-reduces per trial")
    p.add_argument("--trials", type=int, default=5, help="trials per size (the median is kept)")
    p.add_argument("--name", default="allreduce", help="write bench/results/<name>.md and .png")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    nccl = dh.choose_backend("auto", a.nprocs)[0] == "nccl"
    sizes = sizes_up_to(a.max_mib or (256 if nccl else 64))
    records = dh.launch(perf.allreduce_sweep, args=(a.nprocs, sizes, a.iters, a.trials),
                        nprocs=a.nprocs, timeout=600, output="none")
    bw = perf.bandwidths(records)
    ref = reference(bw, records, gpus, a)
    bw["reference"] = ref
    _write(bw, ref, a.name)
    if a.json:
        Path(a.json).write_text(json.dumps(bw, indent=1) + "\n")
    return bw


def _write(bw: dict, ref: dict, name: str) -> None:
    rows = [[_human(s), f"{t * 1e6:,.0f} us", f"{alg:.3f}", f"{bus:.3f}",
             f"{bus / ref['gbps']:.1%}"]
            for s, t, alg, bus in zip(bw["sizes_bytes"], bw["seconds"], bw["algbw"], bw["busbw"])]
    clock = "CUDA events" if bw["device"] == "cuda" else "time.perf_counter"
    short = "link copy" if "peer_access" in ref else "memory copy"
    best = max(bw["busbw"])
    notes = (f"{bw['world_size']} ranks, {bw['backend']} on {bw['device']}, timed with {clock}; "
             f"busbw = algbw x 2(N-1)/N = algbw x {perf.bus_factor(bw['world_size']):g}. "
             f"Reference, {ref['name']}, same run: {ref['gbps']:.2f} GB/s. Best busbw: "
             f"{best:.3f} GB/s, {best / ref['gbps']:.1%} of the {short}. {ref.get('note', '')}")
    write_table(name, ["message", "median time (slowest rank)", "algbw GB/s", "busbw GB/s",
                       f"busbw / {short}"], rows, notes=notes.strip())
    fig = perf_plots.bandwidth_plot(bw)
    if "peer_access" in ref:  # the plot's own line is the on-device copy: add the link
        ax = fig.axes[0]
        ax.axhline(ref["gbps"], color="tab:red", linestyle="-.", label=ref["name"])
        ax.legend(fontsize=8)
    fig.savefig(RESULTS / f"{name}.png", dpi=100)
    print(f"plot: {RESULTS / f'{name}.png'}")


if __name__ == "__main__":
    main()
