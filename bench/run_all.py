"""Every benchmark of the kit in one command (`make bench`), then bench/results/README.md.

    python -m bench.run_all [--quick]

Each script prints its side-by-side figures and ratios and writes bench/results/<name>.md (and
PNG plots); the README gathers every table with the date, machine and versions they came from.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import time
import traceback
from pathlib import Path

from bench.common import RESULTS, machine_line

# (module, arguments for a full run, arguments for --quick)
SCRIPTS = [
    ("launch", [], ["--repeats", "5", "--slow-repeats", "2"]),
    ("ranks", [], ["--starts", "3", "--cells", "50"]),
    ("debugging", [], ["--repeats", "3"]),
    ("exercise_checks", [], ["--repeats", "1"]),
    ("mnist_epoch", ["--results-dir", str(RESULTS)],
     ["--results-dir", str(RESULTS), "--variants", "fixed,memory"]),
    ("allreduce", [], ["--max-mib", "4", "--trials", "3"]),
    ("scaling", [], ["--repeats", "1", "--batches", "64"]),
]


def run_one(name: str, argv: list[str]) -> str:
    """Run bench/<name>.py's main; return "ok", "skipped: ..." or "failed: ..."."""
    if not (Path(__file__).parent / f"{name}.py").exists():
        print(f"NOTE: bench/{name}.py does not exist yet in this checkout: skipped.")
        return "skipped (script not in this checkout)"
    module = importlib.import_module(f"bench.{name}")
    try:
        if inspect.signature(module.main).parameters:
            module.main(argv)
        else:
            module.main()
    except Exception as e:  # noqa: BLE001 - one failing benchmark must not hide the others
        traceback.print_exc()
        return f"failed: {type(e).__name__}: {e}"
    return "ok"


def write_readme(status: dict[str, tuple[str, float]]) -> Path:
    """bench/results/README.md: when and where, each script's status, then every table."""
    lines = ["# Benchmark results", "",
             f"Measured {machine_line()}.", "",
             "Reproduce with `make bench` (or `python -m bench.run_all`). Each table comes from "
             "one run of its script, so the figures side by side were measured together; only "
             "the ratios travel to another machine.", "",
             "| script | status | seconds |", "|---|---|---|"]
    lines += [f"| bench/{n}.py | {s} | {t:.0f} |" for n, (s, t) in status.items()]
    for name in status:
        table = RESULTS / f"{name}.md"
        if not table.exists():
            continue
        body = table.read_text().splitlines()
        body = body[1:] if body and body[0].startswith("# ") else body
        lines += ["", f"## {name}", f"([{name}.md]({name}.md))", *body]
        for png in sorted(RESULTS.glob(f"{name}*.png")):
            lines += ["", f"![{png.stem}]({png.name})"]
    path = RESULTS / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Run every benchmark in turn and write the README; return 1 if any failed."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repeats and smaller sweeps")
    a = p.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    status: dict[str, tuple[str, float]] = {}
    for name, full, quick in SCRIPTS:
        print(f"\n=== bench/{name}.py ===", flush=True)
        t0 = time.perf_counter()
        result = run_one(name, quick if a.quick else full)
        status[name] = (result, time.perf_counter() - t0)
        print(f"--- bench/{name}.py: {result} in {status[name][1]:.0f} s", flush=True)
    print(f"\nwrote {write_readme(status)}")
    return 1 if any(s.startswith("failed") for s, _ in status.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
