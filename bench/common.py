"""Shared by the benchmark scripts: timing, medians, the markdown table and the machine line."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

from ddp_helpers.runtime import gpu_count

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn: Callable[[], object], repeats: int, warmup: int = 0) -> list[float]:
    """Wall-clock seconds of each of `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    """The median, the figure every benchmark quotes (robust on a shared, noisy machine)."""
    return statistics.median(xs)


def machine_line() -> str:
    """Date, machine and versions, printed above every table."""
    gpus = gpu_count()
    return (f"{date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} cores, "
            f"{gpus} GPU(s), Python {platform.python_version()}, torch {torch.__version__}")


def write_table(name: str, header: list[str], rows: list[list[str]], notes: str = "") -> Path:
    """Write bench/results/<name>.md and print the same table."""
    lines = [f"# {name}", "", machine_line(), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if notes:
        lines += ["", notes]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    print(text)
    return path
