"""Lesson 08's Slurm side, parent only: what examples/slurm_torchrun.sh asks torchrun for, given
Slurm's variables, found by running the script itself with a fake `scontrol` (no cluster needed)."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm_torchrun.sh"

# Fake allocations for the exercise's check: what srun would set on one node of each.
ALLOCATIONS = [
    ({"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2",
      "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2"}, ["gpu07", "gpu08"]),
    ({"SLURM_JOB_ID": "918273", "SLURM_JOB_NODELIST": "a100-[3,5,9-10]",
      "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "SLURM_GPUS_ON_NODE": "8"},
     ["a100-3", "a100-5", "a100-9", "a100-10"]),
    ({"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "cpu01", "SLURM_JOB_NUM_NODES": "1",
      "SLURM_NODEID": "0", "MASTER_PORT": "12345"}, ["cpu01"]),
]
_OURS = ("MASTER_PORT", "NPROC_PER_NODE", "TORCHRUN", "MAX_RESTARTS", "DRY_RUN")


def slurm_torchrun_command(env: dict[str, str], hostnames: list[str]) -> list[str]:
    """The torchrun command slurm_torchrun.sh builds on a node with these Slurm variables."""
    with tempfile.TemporaryDirectory() as bin_dir:
        scontrol = Path(bin_dir, "scontrol")  # prints the node list, as the real one would
        scontrol.write_text("#!/bin/sh\nprintf '%s\\n' "
                            + " ".join(shlex.quote(h) for h in hostnames) + "\n")
        scontrol.chmod(0o755)
        full = {k: v for k, v in os.environ.items()
                if not k.startswith("SLURM_") and k not in _OURS}
        full.update(env, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", DRY_RUN="1")
        p = subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True,
                           timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"{SCRIPT.name} failed with exit code {p.returncode}: "
                           f"{p.stderr.strip()}")
    return p.stdout.split()


def flags(command: list[str]) -> dict[str, str]:
    """The --flag value pairs of a command line, as a dict."""
    return {a: b for a, b in zip(command, command[1:]) if a.startswith("--")}


def check_torchrun_flags(fn: Callable[[dict, list[str]], dict[str, str]]) -> bool:
    """Compare fn(env, hostnames) with the flags the Slurm script builds, per fake allocation."""
    ok = True
    for env, hosts in ALLOCATIONS:
        name = f"job {env['SLURM_JOB_ID']}, node {env['SLURM_NODEID']}"
        expected = flags(slurm_torchrun_command(env, hosts))
        got = fn(dict(env), list(hosts))
        wrong = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
        extra = sorted(set(got) - set(expected))
        if not wrong and not extra:
            print(f"PASS {name}: exact ({len(expected)} flags)")
            continue
        ok = False
        parts = [f"{k} is {g!r}, expected {e!r}" for k, (g, e) in wrong.items()]
        parts += [f"{k} is not in the script's command" for k in extra]
        print(f"FAIL {name}: " + "; ".join(parts))
    return ok
