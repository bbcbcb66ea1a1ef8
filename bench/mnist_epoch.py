"""One epoch of the seed's MNIST exercise on two ranks, gloo on CPU, three ways side by side:
the listing as printed (faithful), the listing with the sampler fix, and the kit's fast path.

    python -m bench.mnist_epoch [--results-dir bench/results] [--variants faithful,fixed,memory]
    python bench/mnist_epoch.py ...   (the same)

Prints seconds per epoch (the slower rank's), test accuracy, and the ratios against the targets:
fast path >= 50x faster than faithful, >= 15x faster than fixed, accuracy within one point of fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddp_helpers as dh
from bench.common import machine_line
from ddp_helpers import data
from ddp_helpers.lessons import mnist_two_gpus as mnist
from ddp_helpers.timing import format_seconds

LABELS = {"faithful": "listing as printed (no sampler)", "fixed": "listing + DistributedSampler",
          "memory": "kit fast path (in-memory)"}


def run_variant(variant: str, source: data.DataSource, nprocs: int = 2) -> dict:
    """One epoch of `variant` on nprocs gloo ranks: seconds, accuracy, samples per rank."""
    cfg = mnist.MnistConfig(source=source, epochs=1, progress_lines=1)
    start = time.perf_counter()
    results = dh.launch(mnist.VARIANTS[variant], args=(nprocs, cfg), nprocs=nprocs,
                        timeout=1800, output="none", backend="gloo")
    wall = time.perf_counter() - start
    return {"variant": variant, "epoch_s": max(r["epoch_s"][0] for r in results),
            "wall_s": wall, "accuracy": results[0]["accuracy"],
            "samples_per_rank": results[0]["samples_seen"], "steps": len(results[0]["loss"]),
            "sync_s": _slowest_total([r["sync_s"] for r in results]),
            "data_s": max(sum(r["data_s"]) for r in results)}


def _slowest_total(per_rank: list[list[float | None]]) -> float | None:
    """The largest per-rank sum, or None when any step's time was not measured (NaN/None)."""
    steps = [s for xs in per_rank for s in xs]
    if any(s is None or math.isnan(s) for s in steps):
        return None  # printed as "not measured", never as a sum of made-up zeros
    return max(sum(xs) for xs in per_rank)


def table(rows: list[dict]) -> list[str]:
    """Markdown table rows: one per variant, with its speed-up over the fast path."""
    fast = next((r for r in rows if r["variant"] == "memory"), None)
    lines = ["| variant | s / epoch | vs fast path | test accuracy | samples per rank | steps |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['epoch_s'] / fast['epoch_s']:.1f}x" if fast else "-"
        lines.append(f"| {LABELS[r['variant']]} | {r['epoch_s']:.2f} | {ratio} | "
                     f"{r['accuracy']:.4f} | {r['samples_per_rank']:,} | {r['steps']} |")
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    """The targets, each with the measured number and PASS or MISS."""
    by = {r["variant"]: r for r in rows}
    if "memory" not in by:
        return []
    fast, out = by["memory"], []
    for slow, target in (("faithful", 50), ("fixed", 15)):
        if slow in by:
            ratio = by[slow]["epoch_s"] / fast["epoch_s"]
            out.append(f"fast path vs {slow}: {ratio:.1f}x (target >= {target}x) "
                       f"{'PASS' if ratio >= target else 'MISS'}")
    if fast["steps"] and fast["sync_s"] is not None:
        out.append(f"fast path floor: {fast['sync_s']:.2f} s of its {fast['epoch_s']:.2f} s are "
                   f"the {fast['steps']} gradient all-reduces DDP needs, one per step "
                   f"({1000 * fast['sync_s'] / fast['steps']:.2f} ms each on this machine)")
    if "fixed" in by:
        points = 100 * abs(fast["accuracy"] - by["fixed"]["accuracy"])
        out.append(f"accuracy, fast path vs fixed: {points:.2f} points apart (target <= 1) "
                   f"{'PASS' if points <= 1 else 'MISS'}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print it; write the table too if --results-dir is given."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="faithful,fixed,memory")
    p.add_argument("--results-dir", default=None)
    p.add_argument("--data-root", default=None)
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(mnist.VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}: choose from {', '.join(mnist.VARIANTS)}")
    source = data.prepare_data(args.data_root)  # once, here: the ranks only read it
    rows = []
    for v in variants:
        print(f"running {v}: {LABELS[v]} ...", flush=True)
        rows.append(run_variant(v, source))
        r = rows[-1]
        print(f"  {r['epoch_s']:.2f} s per epoch (launch to results {r['wall_s']:.1f} s), "
              f"accuracy {r['accuracy']:.4f}, gradient sync {format_seconds(r['sync_s'])}, "
              f"waiting for data {r['data_s']:.2f} s", flush=True)
    lines = table(rows)
    print("\n".join(["", machine_line(), "", *lines, "", *verdicts(rows)]))
    if args.results_dir:
        out = Path(args.results_dir)
        out.mkdir(parents=True, exist_ok=True)
        note = (f"2 ranks, gloo on CPU, one epoch, batch 64 per rank; {source.describe()}; "
                f"{time.strftime('%Y-%m-%d %H:%M')}")
        text = ["# mnist_epoch", "", machine_line(), "", *lines, "", note, "", *verdicts(rows)]
        (out / "mnist_epoch.md").write_text("\n".join(text) + "\n")
        (out / "mnist_epoch.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {out / 'mnist_epoch.md'} and {out / 'mnist_epoch.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
