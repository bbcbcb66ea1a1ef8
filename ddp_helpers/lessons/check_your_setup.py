"""Lesson 00 (notebooks/00_check_your_setup.ipynb): what this machine has, what the kit
chooses, and a summary to paste into a question.

Everything here runs in the parent except `two_rank_all_reduce`, which the ranks run. GPU facts
come from torch.cuda.device_count and nvidia-smi, never from a CUDA context in the kernel.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess

import torch
import torch.distributed as dist

from ddp_helpers import launch
from ddp_helpers.checks import Case, case
from ddp_helpers.exercises import exercise_check, require
from ddp_helpers.runtime import available_backends, choose_backend, gpu_count, process_group

DIST = "ddp-helpers"  # the kit's distribution name, whose metadata states its floors


def _version_tuple(text: str, parts: int = 2) -> tuple[int, ...]:
    """(major, minor) of "2.14.1+cu130"; parts=3 keeps the patch level too."""
    found = []
    for piece in text.split("+")[0].split(".")[:parts]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        found.append(int(digits or 0))
    return tuple(found + [0] * (parts - len(found)))


def floors() -> dict[str, str]:
    """The lowest Python, torch and torchvision the installed kit requires, from its metadata.

    Read from what pip installed (pyproject.toml's ranges), so the floor is stated in one place;
    {} when the kit is not installed (run from a bare checkout: `pip install -e .` fixes that).
    """
    try:
        meta = importlib.metadata.metadata(DIST)
        requires = importlib.metadata.requires(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    found = {"python": (meta.get("Requires-Python") or "").removeprefix(">=").strip()}
    for req in requires:
        m = re.fullmatch(r"(torch|torchvision)\s*>=\s*([0-9.]+)", req.split(";")[0].strip())
        if m:
            found[m.group(1)] = m.group(2)
    return {name: version for name, version in found.items() if version}


_FLOORS = floors()
MIN_PYTHON = _version_tuple(_FLOORS.get("python", "0"))
MIN_TORCH = _version_tuple(_FLOORS.get("torch", "0"), parts=3)  # 2.9.1: a patch release counts


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
    """One dict per visible GPU (name, memory) from nvidia-smi; [] without GPUs. Where a name
    cannot be matched to torch's index, "name" is None and "why" says why."""
    count = gpu_count()
    if count == 0:
        return []
    rows, why = _smi_rows(count)
    if why:
        return [{"index": i, "name": None, "memory": None, "why": why} for i in range(count)]
    return [{"index": i, "name": name, "memory": memory} for i, (name, memory) in enumerate(rows)]


def _smi_rows(count: int) -> tuple[list[list[str]], str]:
    """nvidia-smi's (name, memory) rows, or the reason they cannot name torch's GPUs 0..count-1:
    nvidia-smi lists every GPU in PCI bus order, while torch sees only CUDA_VISIBLE_DEVICES,
    in CUDA's order (CUDA_DEVICE_ORDER, FASTEST_FIRST unless set to PCI_BUS_ID)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi on PATH"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [], f"CUDA_VISIBLE_DEVICES={visible} is set; run nvidia-smi -L"
    # nvidia-smi, not torch.cuda.get_device_properties: that would create a CUDA context in
    # the kernel, and a kernel holding CUDA must never be forked.
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return [], "nvidia-smi did not answer"
    rows = [line.split(", ") for line in out.strip().splitlines() if line.strip()]
    if len(rows) != count or any(len(row) != 2 for row in rows):
        return [], f"nvidia-smi lists {len(rows)} GPU(s), torch sees {count}"
    if len({name for name, _ in rows}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return [], ("different GPU models, and CUDA numbers them fastest first, nvidia-smi by "
                    "PCI bus: set CUDA_DEVICE_ORDER=PCI_BUS_ID, or run nvidia-smi -L")
    return rows, ""


def gpu_text(gpu: dict) -> str:
    """'NVIDIA H100 80GB HBM3 (81559 MiB)', or 'name not shown (why)'."""
    if gpu["name"] is None:
        return f"name not shown ({gpu['why']})"
    return f"{gpu['name']} ({gpu['memory']})"


def collect_report(nprocs: int = 2) -> dict:
    """Everything lesson 00 prints, gathered once."""
    backend, device, why = choose_backend("auto", nprocs)
    return {"versions": versions(), "cpu": cpu_info(), "gpus": gpu_info(),
            "backends": {name: name in available_backends() for name in ("gloo", "nccl", "mpi")},
            "distributed": dist.is_available(),
            "choice": {"nprocs": nprocs, "backend": backend, "device": device, "why": why}}


def print_section(report: dict, section: str) -> None:
    """Print one section of the report as aligned `name: value` lines."""
    value = report[section]
    if section == "gpus":
        if not value:
            print("no CUDA GPU visible")
        for gpu in value:
            print(f"GPU {gpu['index']}: {gpu_text(gpu)}")
        return
    for key, item in value.items():
        if section == "backends":
            item = "available" if item else "not in this build"
        print(f"{key:<24} {item}")


def two_rank_all_reduce(rank: int, world_size: int) -> dict:
    """Each rank contributes rank + 1; after all_reduce every rank should hold the sum."""
    with process_group(rank, world_size) as device:
        t = torch.full((3,), float(rank + 1), device=device)
        before = t.cpu().clone()
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "backend": dist.get_backend(),
                "device": device.type, "before": before, "result": t.cpu()}


def expected_sum(world_size: int) -> float:
    """1 + 2 + ... + world_size: what two_rank_all_reduce should give."""
    return world_size * (world_size + 1) / 2


def checks(report: dict, results: list[dict] | None) -> list[tuple[str, bool, str]]:
    """(what, passed, detail) for each requirement of the kit, read from the report and the
    all-reduce's results only, so that each check fails when what it reads is wrong."""
    v = report["versions"]
    py_ok = _version_tuple(v["python"]) >= MIN_PYTHON
    torch_ok = _version_tuple(v["torch"], parts=3) >= MIN_TORCH
    return [
        _floor_check("Python", py_ok, v["python"]),
        _floor_check("torch", torch_ok, v["torch"]),
        ("torch.distributed available", report["distributed"], ""),
        ("gloo backend available", report["backends"]["gloo"], "every lesson can run on CPU"),
        _choice_check(report["choice"], results),
        _all_reduce_check(results),
    ]


def _floor_check(name: str, ok: bool, have: str) -> tuple[str, bool, str]:
    """`name` at or above the kit's floor; FAIL when the kit is not installed (no floor to read),
    since a check that passes against an unknown floor says nothing."""
    if name.lower() in _FLOORS:
        return (f"{name} {_FLOORS[name.lower()]} or newer", ok, have)
    return (f"{name} at the kit's floor", False,
            f"{have}; the kit is not installed, so its floor is unknown: "
            "run `pip install -e .` in the checkout")


def _choice_check(choice: dict, results: list[dict] | None) -> tuple[str, bool, str]:
    """Did the ranks run on the backend and device the kit chose (and why it chose them)?"""
    what = "ranks used the kit's backend choice"
    chose = f"{choice['backend']} on {choice['device']}"
    if results is None:
        return what, False, f"chose {chose}; not run yet"
    used = sorted({f"{r['backend']} on {r['device']}" for r in results})
    if used == [chose]:
        return what, True, f"{chose}: {choice['why']}"
    return what, False, f"chose {chose}, the ranks used {', '.join(used)}"


def _all_reduce_check(results: list[dict] | None) -> tuple[str, bool, str]:
    """Does every rank hold 1 + 2 + ... + world_size after the all_reduce?"""
    if results is None:
        return "two-rank all_reduce", False, "not run yet"
    want = expected_sum(len(results))
    got = [r["result"].tolist() for r in results]
    ok = all(x == [want] * 3 for x in got)
    return ("two-rank all_reduce", ok,
            f"every rank holds {want:g}" if ok else f"expected {want:g}, got {got}")


def summary(report: dict, results: list[dict] | None) -> str:
    """A plain-text block to paste into a question: versions, hardware, checks."""
    lines = ["--- ddp_helpers setup check ---"]
    lines += [f"{k}: {val}" for k, val in report["versions"].items()]
    cpu = report["cpu"]
    lines.append(f"cpu: {cpu['logical cores']} logical, {cpu['usable by this process']} usable, "
                 f"{cpu['physical cores']} physical")
    gpus = report["gpus"]
    lines.append("gpus: " + (", ".join(gpu_text(g) for g in gpus) if gpus else "none"))
    lines.append("backends: " + ", ".join(k for k, ok in report["backends"].items() if ok))
    for what, ok, detail in checks(report, results):
        lines.append(f"{'PASS' if ok else 'FAIL'}  {what}" + (f"  ({detail})" if detail else ""))
    lines.append(f"NOTE  {cores_note(report)}")
    return "\n".join(lines)


def cores_note(report: dict) -> str:
    """The core count, as information rather than a check: with fewer cores than ranks the
    ranks take turns, slower but still correct, so it never fails the verdict."""
    usable = report["cpu"]["usable by this process"] or 1
    if usable >= 2:
        return f"{usable} usable CPU cores: two ranks run side by side"
    return "1 usable CPU core: the ranks take turns, so the lessons run slower (but correctly)"


def verdict(report: dict, results: list[dict] | None) -> str:
    """One line: how many checks passed, and which failed."""
    found = checks(report, results)
    failed = [what for what, ok, _ in found if not ok]
    if not failed:
        return f"all {len(found)} checks passed: this machine is ready for the lessons"
    return (f"{len(failed)} of {len(found)} checks failed: {', '.join(failed)}. Paste the "
            "summary above into your question.")


# -- exercises --------------------------------------------------------------------------------

def _observed_sum_of_squares(rank: int, fn, world_size: int) -> tuple:
    """On a rank: the learner's fn(rank, world_size) under a Ledger; (its result, the ops it
    called, the values each all_reduce was handed), so that the check sees how the total was
    made, not only the number."""
    from ddp_helpers.ledger import Ledger

    with Ledger(keep_inputs=True) as ledger:
        value = fn(rank, world_size)
    handed = [[float(x) for t in given for x in t.flatten().tolist()]
              for call, given in zip(ledger.calls, ledger.inputs) if call.op == "all_reduce"]
    return value, [c.op for c in ledger.calls], handed


@exercise_check("sum_of_squares", "file")
def check_sum_of_squares(module) -> list:
    """The learner's sum_of_squares(rank, world_size), launched on 2 and on 3 ranks: every rank
    returns the total and got it from an all_reduce (the ledger sees the call whatever name it
    was imported under; a closed form or a reduce to rank 0 is not the exercise)."""
    fn = require(module, "sum_of_squares")
    cases = []
    for n in (2, 3):
        got = launch(_observed_sum_of_squares, args=(fn, n), nprocs=n, timeout=120,
                     output="none")
        want = float(sum((r + 1) ** 2 for r in range(n)))
        for r, (value, ops, handed) in enumerate(got):
            called = ", ".join(ops) or "no collective"
            cases.append(Case(f"{n} ranks: rank {r} calls all_reduce", "all_reduce" in ops,
                              f"rank {r} called {called}; every rank all-reduces its "
                              "(rank + 1) ** 2"))
            cases.append(case(f"{n} ranks: rank {r}'s total", value, want))
            # A dummy all_reduce beside a closed-form total is not the exercise.
            mine = float((r + 1) ** 2)
            cases.append(Case(f"{n} ranks: rank {r} all-reduces (rank + 1) ** 2",
                              any(mine in values for values in handed),
                              f"rank {r}'s all_reduce was handed {handed or 'nothing'}, not "
                              f"{mine:g}: the total must come from the ranks' contributions"))
    return cases


@exercise_check("three_rank_sum", "prediction", wrong_answer=3.0)
def check_three_rank_sum(predicted) -> list:
    """The learner's prediction of what every rank holds after two_rank_all_reduce on 3 ranks,
    checked against a real run."""
    results = launch(two_rank_all_reduce, args=(3,), nprocs=3, timeout=120, output="none")
    return [case(f"rank {r['rank']}", float(predicted), r["result"][0].item())
            for r in results]
