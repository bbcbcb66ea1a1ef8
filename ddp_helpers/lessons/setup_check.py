"""Lesson 00: what this machine has, what the kit chooses, and a summary to paste into a question.

Everything here runs in the parent except `two_rank_all_reduce`, which the ranks run. GPU facts
come from torch.cuda.device_count and nvidia-smi, never from a CUDA context in the kernel.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist

from ddp_helpers.runtime import available_backends, choose_backend, gpu_count, process_group

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def versions() -> dict:
    """Python, torch, torchvision, CUDA and NCCL versions (None where absent)."""
    try:
        import torchvision
        vision = torchvision.__version__
    except ImportError:
        vision = None
    nccl = None
    if dist.is_nccl_available() and torch.version.cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):  # a build with CUDA but NCCL not loadable
            nccl = None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torchvision": vision, "cuda (torch built with)": torch.version.cuda,
            "nccl": nccl, "os": f"{platform.system()} {platform.release()}"}


def cpu_info() -> dict:
    """Logical cores, the cores this process may use, and physical cores when psutil knows."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        import psutil
        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return {"logical cores": os.cpu_count(), "usable by this process": usable,
            "physical cores": physical}


def gpu_info() -> list[dict]:
    """One dict per visible GPU (name, memory) from nvidia-smi; [] without GPUs."""
    count = gpu_count()
    if count == 0:
        return []
    gpus = [{"index": i, "name": "?", "memory": "?"} for i in range(count)]
    smi = shutil.which("nvidia-smi")
    if smi:
        # nvidia-smi, not torch.cuda.get_device_properties: that would create a CUDA context in
        # the kernel, and a kernel holding CUDA must never be forked.
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        rows = [line.split(", ") for line in out.strip().splitlines() if line.strip()]
        if visible is None and len(rows) == count:
            for gpu, (name, memory) in zip(gpus, rows, strict=True):
                gpu.update(name=name, memory=memory)
    return gpus


def collect_report(nprocs: int = 2) -> dict:
    """Everything lesson 00 prints, gathered once."""
    backend, device, why = choose_backend("auto", nprocs)
    return {"versions": versions(), "cpu": cpu_info(), "gpus": gpu_info(),
            "backends": {name: name in available_backends() for name in ("gloo", "nccl", "mpi")},
            "choice": {"nprocs": nprocs, "backend": backend, "device": device, "why": why}}


def print_section(report: dict, section: str) -> None:
    """Print one section of the report as aligned `name: value` lines."""
    value = report[section]
    if section == "gpus":
        if not value:
            print("no CUDA GPU visible")
        for gpu in value:
            print(f"GPU {gpu['index']}: {gpu['name']} ({gpu['memory']})")
        return
    for key, item in value.items():
        if section == "backends":
            item = "available" if item else "not in this build"
        print(f"{key:<24} {item}")


def two_rank_all_reduce(rank: int, world_size: int) -> dict:
    """Each rank contributes rank + 1; after all_reduce every rank should hold the sum."""
    with process_group(rank, world_size) as device:
        t = torch.full((3,), float(rank + 1), device=device)
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "backend": dist.get_backend(),
                "device": device.type, "result": t.cpu()}


def expected_sum(world_size: int) -> float:
    """1 + 2 + ... + world_size: what two_rank_all_reduce should give."""
    return world_size * (world_size + 1) / 2


def checks(report: dict, results: list[dict] | None) -> list[tuple[str, bool, str]]:
    """(what, passed, detail) for each requirement of the kit."""
    v = report["versions"]
    py_ok = sys.version_info[:2] >= MIN_PYTHON
    torch_ok = _version_tuple(v["torch"]) >= MIN_TORCH
    out = [
        ("Python 3.10 or newer", py_ok, v["python"]),
        ("torch 2.4 or newer", torch_ok, v["torch"]),
        ("torch.distributed available", dist.is_available(), ""),
        ("gloo backend available", report["backends"]["gloo"], "every lesson can run on CPU"),
        ("at least 2 usable CPU cores", (report["cpu"]["usable by this process"] or 1) >= 2,
         f"{report['cpu']['usable by this process']} usable"),
    ]
    choice = report["choice"]
    out.append(("kit's backend choice", True,
                f"{choice['backend']} on {choice['device']}: {choice['why']}"))
    if results is None:
        out.append(("two-rank all_reduce", False, "not run yet"))
    else:
        want = expected_sum(len(results))
        got = [r["result"].tolist() for r in results]
        ok = all(x == [want] * 3 for x in got)
        out.append(("two-rank all_reduce", ok,
                    f"every rank holds {want:g}" if ok else f"expected {want:g}, got {got}"))
    return out


def summary(report: dict, results: list[dict] | None) -> str:
    """A plain-text block to paste into a question: versions, hardware, checks."""
    lines = ["--- ddp_helpers setup check ---"]
    lines += [f"{k}: {val}" for k, val in report["versions"].items()]
    cpu = report["cpu"]
    lines.append(f"cpu: {cpu['logical cores']} logical, {cpu['usable by this process']} usable, "
                 f"{cpu['physical cores']} physical")
    gpus = report["gpus"]
    lines.append("gpus: " + (", ".join(f"{g['name']} ({g['memory']})" for g in gpus)
                             if gpus else "none"))
    lines.append("backends: " + ", ".join(k for k, ok in report["backends"].items() if ok))
    for what, ok, detail in checks(report, results):
        lines.append(f"{'PASS' if ok else 'FAIL'}  {what}" + (f"  ({detail})" if detail else ""))
    return "\n".join(lines)


def verdict(report: dict, results: list[dict] | None) -> str:
    """One line: how many checks passed, and which failed."""
    found = checks(report, results)
    failed = [what for what, ok, _ in found if not ok]
    if not failed:
        return f"all {len(found)} checks passed: this machine is ready for the lessons"
    return (f"{len(failed)} of {len(found)} checks failed: {', '.join(failed)}. Paste the "
            "summary above into your question.")
