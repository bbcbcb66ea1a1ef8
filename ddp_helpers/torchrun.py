"""torchrun from a notebook cell: start `torchrun ...` command lines at once (one agent per
"node"), wait for them, and bring back each one's exit code and output without machine paths,
so that a committed notebook can show them. Lessons 07 and 08 use it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .engine import clean_error_text

ROOT = Path(__file__).resolve().parents[1]  # the checkout: agents run from there


def torchrun_agents(commands: list[str], envs: list[dict] | None = None, timeout: float = 240,
                    log_dir: str | os.PathLike | None = None) -> list[dict]:
    """Start every command at once (each a `torchrun ...` line: one agent, i.e. one "node") and
    wait for all; torchrun is this venv's, with `--log-dir log_dir` (its error files go there;
    without log_dir, a temporary folder removed afterwards, where torchrun alone would leave a
    /tmp/torchelastic_* folder behind per agent). Each agent's exit code and output come back,
    the output without machine paths: the log folder shown as <logs>, other temporary paths as
    <tmp>, the rest relative to the checkout."""
    with tempfile.TemporaryDirectory(prefix="torchrun_logs_") as own_logs:
        return _run_agents(commands, envs or [{}] * len(commands), timeout,
                           own_logs if log_dir is None else log_dir)


def _run_agents(commands: list[str], envs: list[dict], timeout: float,
                log_dir: str | os.PathLike) -> list[dict]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(log_dir)]
    procs = [subprocess.Popen(torchrun + shlex.split(cmd)[1:], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, **env}, start_new_session=True)
             for cmd, env in zip(commands, envs)]
    runs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            runs.append({"returncode": p.returncode, "output": readable(out, log_dir)})
    finally:
        for p in procs:  # a hung agent: stop it and its workers
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return runs


def readable(text: str, log_dir: str | os.PathLike | None = None) -> str:
    """torchrun's output without this machine's paths (for a notebook's committed output)."""
    # Library files by their package path alone (torch/...), wherever the venv is: first, since
    # the venv itself may sit under the temporary folder replaced below.
    text = re.sub(r"(?<![\w.])/[^\s\"']*?(?:site|dist)-packages/", "", text)
    swaps = [(sys.executable, "python"), (os.path.realpath(sys.executable), "python")]
    if log_dir is not None:
        swaps += [(os.path.realpath(log_dir), "<logs>"), (str(log_dir), "<logs>")]
    swaps += [(os.path.realpath(tempfile.gettempdir()), "<tmp>"), (tempfile.gettempdir(), "<tmp>")]
    for old, new in swaps:
        text = text.replace(old, new)
    # Per line: no C++ source locations, no caret lines (they change with the torch and Python
    # versions), relative library paths (torchrun logs .venv/lib/.../site-packages/torch/...).
    lines = [re.sub(r"\S*(?:site|dist)-packages/", "", clean_error_text(line))
             for line in text.splitlines()
             if not re.fullmatch(r"(\[rank\d+\]:)?\s*[\^~]+[\s^~]*", line)]
    return "\n".join(lines) + "\n" if lines else ""
