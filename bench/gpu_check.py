"""`make gpu-check`: every GPU path of the kit, run in one go on a GPU machine, with a summary.

    python bench/gpu_check.py [--budget-s S] [--workers K]

In this order, each step with its own timeout and all of them inside one deadline (8 minutes
with one GPU, 15 with two or more, after the environment is installed):
  1. GPU facts and copies: names, versions, host->GPU copies (pageable and pinned), an on-GPU
     copy and, with two GPUs, the cuda:0 -> cuda:1 link (peer access on or off), CUDA events.
  2. every `gpu`-marked test (pytest -m gpu tests)
  3. the MNIST command on all GPUs: python -m ddp_helpers.mnist --nprocs <GPUs> --epochs 1
  4. with two GPUs or more: bench/allreduce.py with NCCL, up to 256 MiB
  5. every lesson (00-11) top to bottom, execution only (pytest --nbval-lax), K at a time
Then a summary table (printed, and written to bench/results/gpu.md with the date and the GPU),
and what needs two GPUs and did not run. Logs go to runs/gpu-check-<time>/. Exit status 0
when every step that ran passed. Without a GPU: "no GPU: nothing to check", exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a file: make `bench` and the kit importable
    sys.path.insert(0, str(REPO))

import ddp_helpers as dh  # noqa: E402 - after the path fix above

RESULTS = REPO / "bench" / "results" / "gpu.md"
LESSONS = sorted(REPO.glob("notebooks/[0-9][0-9]_*.ipynb"))
NEEDS_TWO = "NEEDS TWO GPUS: not run"
MIN_STEP_S = 20  # a step with less time than this left is reported as not run, not started


@dataclass
class Step:
    """One line of the summary table."""

    name: str
    device: str
    backend: str
    status: str = "NOT RUN (out of time)"  # or PASS, FAIL, TIMEOUT, NEEDS TWO GPUS
    detail: str = ""  # e.g. "9 passed, 5 skipped"
    figures: str = ""
    seconds: float = 0.0

    @property
    def result(self) -> str:
        return f"{self.status}: {self.detail}" if self.detail else self.status

    @property
    def failed(self) -> bool:
        return self.status not in ("PASS", NEEDS_TWO)


class Proc:
    """A child command in its own process group, its output in a log, stopped at its timeout."""

    def __init__(self, cmd: list[str], log: Path, timeout: float, env: dict):
        self.log, self.timeout, self.t0 = log, timeout, time.monotonic()
        with open(log, "w") as out:  # the child keeps its own copy of the descriptor
            self.p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.timed_out = False

    def poll(self) -> bool:
        """True once the command has ended (or was stopped at its timeout)."""
        if self.p.poll() is not None:
            return True
        if time.monotonic() - self.t0 > self.timeout:
            self.timed_out = True
            self._stop()
            return True
        return False

    def wait(self) -> Proc:
        while not self.poll():
            time.sleep(0.5)
        return self

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.t0

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def _stop(self) -> None:
        # The whole group: pytest and the ranks it launched. SIGINT first, as Ctrl-C would: pytest
        # then shuts its notebook kernel down and the kit's launcher stops its ranks; SIGTERM and
        # SIGKILL for whatever is still there after that.
        for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.p.pid, sig)
                self.p.wait(grace)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


class Check:
    """The whole run: the deadline, the log folder, the steps done so far."""

    def __init__(self, gpus: int, budget_s: float, workers: int):
        self.gpus, self.workers = gpus, workers
        self.deadline = time.monotonic() + budget_s
        self.logs = REPO / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.steps: list[Step] = []
        self.facts: dict = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "DDP_HELPERS_OFFLINE": "1"}  # a GPU box may have no network: never wait on it
        self.cuda = ", ".join(f"cuda:{i}" for i in range(min(gpus, 2))) + (
            f" .. cuda:{gpus - 1}" if gpus > 2 else "")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, name: str, cmd: list[str], cap: float, env: dict | None = None) -> Proc | None:
        """Start cmd with min(cap, time left) as its timeout; None when too little time is left."""
        if self.left() < MIN_STEP_S:
            return None
        log = self.logs / (re.sub(r"\W+", "_", name).strip("_") + ".log")
        print(f"[{self._clock()}] {name} (up to {min(cap, self.left()):.0f} s) ...", flush=True)
        return Proc(cmd, log, min(cap, self.left()), env or self.env)

    def finish(self, step: Step, proc: Proc | None, passed: bool | None = None) -> Step:
        """Record a finished (or never started) step's result and print it."""
        if proc is not None:
            step.seconds = proc.seconds
            ok = proc.p.returncode == 0 if passed is None else passed
            step.status = "TIMEOUT" if proc.timed_out else "PASS" if ok else "FAIL"
            if step.failed:
                print(f"--- last lines of {proc.log}:\n{proc.tail()}\n---", flush=True)
        print(f"[{self._clock()}] {step.name}: {step.result} {step.figures}".rstrip(), flush=True)
        if not any(s is step for s in self.steps):  # lessons are listed when queued, in order
            self.steps.append(step)
        return step

    def _clock(self) -> str:
        return time.strftime("%H:%M:%S")


def facts_and_copies(out: str) -> None:
    """Child mode (--facts): GPU names, versions and timed copies, as JSON in `out`."""
    import torch

    from ddp_helpers import timing

    n = torch.cuda.device_count()
    mib = 256 << 20
    nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
    f = {"gpus": [torch.cuda.get_device_name(i) for i in range(n)], "torch": torch.__version__,
         "cuda": torch.version.cuda,
         "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}
    gbps = {"host->GPU pageable": timing.copy_seconds(mib, "cpu", "cuda:0"),
            "host->GPU pinned": timing.copy_seconds(mib, "cpu", "cuda:0", pinned=True),
            "on-GPU copy": timing.copy_seconds(mib, "cuda:0")}
    if n >= 2:
        f["peer_access"] = timing.peer_access(0, 1)
        gbps["cuda:0->cuda:1"] = timing.copy_seconds(mib, "cuda:0", "cuda:1")
    f["copy_gbps"] = {k: mib / s / 1e9 for k, s in gbps.items()}
    Path(out).write_text(json.dumps(f))


def step_facts(c: Check) -> None:
    out = c.logs / "facts.json"
    step = Step("GPU facts, copies, CUDA events", c.cuda, "-")
    proc = c.start(step.name, [sys.executable, __file__, "--facts", str(out)], 120)
    if proc is not None:
        proc.wait()
        if proc.p.returncode == 0:
            c.facts = json.loads(out.read_text())
            peer = c.facts.get("peer_access")
            step.figures = "; ".join(
                f"{k} {v:.1f} GB/s" + (f" (peer access {'on' if peer else 'off'})"
                                       if k.startswith("cuda:0->") else "")
                for k, v in c.facts["copy_gbps"].items())
    c.finish(step, proc)


def step_gpu_tests(c: Check) -> list[str]:
    """pytest -m gpu; returns the tests that were skipped for want of a second GPU."""
    xml = c.logs / "gpu_tests.xml"
    step = Step("gpu-marked tests", c.cuda, "nccl + gloo")
    proc = c.start(step.name, [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q",
                               "-p", "no:cacheprovider", f"--junitxml={xml}"], 240)
    skipped: list[str] = []
    if proc is not None:
        proc.wait()
        if xml.exists():
            counts, skipped = _junit(xml)
            step.detail = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    c.finish(step, proc)
    return skipped


def _junit(xml: Path) -> tuple[dict, list[str]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    need_two = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = case.find("skipped").get("message", "")
            if "two" in reason:
                need_two.append(case.get("name"))
        else:
            counts["passed"] += 1
    return counts, need_two


def step_mnist(c: Check) -> None:
    n = c.gpus
    backend, device, _ = dh.choose_backend("auto", n)
    step = Step(f"MNIST, python -m ddp_helpers.mnist --nprocs {n} --epochs 1",
                c.cuda if n >= 2 else "cuda:0", backend)
    proc = c.start(step.name, [sys.executable, "-m", "ddp_helpers.mnist", "--nprocs", str(n),
                               "--epochs", "1", "--out", str(c.logs / "mnist")], 240)
    if proc is not None:
        proc.wait()
        text = proc.log.read_text(errors="replace")
        epochs = [float(s) for s in re.findall(r"^rank \d+: .*?([\d.]+) s training", text, re.M)]
        acc = re.search(r"final test accuracy: ([\d.]+)", text)
        if epochs and acc:
            step.figures = (f"epoch {max(epochs):.1f} s (slowest rank of {len(epochs)}), "
                            f"test accuracy {float(acc.group(1)):.4f}")
        same = "DDP kept them in step): yes" in text
        c.finish(step, proc, passed=proc.p.returncode == 0 and same and bool(epochs))
    else:
        c.finish(step, None)


def step_allreduce(c: Check) -> None:
    if c.gpus < 2:
        c.finish(Step("bench/allreduce.py, NCCL busbw vs cuda:0->cuda:1", "-", "nccl",
                      status=NEEDS_TWO), None)
        return
    out = c.logs / "allreduce.json"
    step = Step(f"bench/allreduce.py, {c.gpus} ranks", c.cuda, "nccl")
    proc = c.start(step.name, [sys.executable, "-m", "bench.allreduce", "--name",
                               "allreduce_gpu", "--json", str(out)], 180)
    if proc is not None:
        proc.wait()
        if proc.p.returncode == 0 and out.exists():
            bw = json.loads(out.read_text())
            best = max(range(len(bw["busbw"])), key=bw["busbw"].__getitem__)
            ref = bw["reference"]
            step.backend = bw["backend"]
            step.figures = (f"busbw {bw['busbw'][best]:.1f} GB/s at "
                            f"{bw['sizes_bytes'][best] >> 20} MiB, "
                            f"{bw['busbw'][best] / ref['gbps']:.0%} of {ref['name']} "
                            f"{ref['gbps']:.1f} GB/s")
    c.finish(step, proc)


def step_lessons(c: Check) -> None:
    """Every lesson under nbval-lax, `workers` at a time, each with its own timeout."""
    backend, device, _ = dh.choose_backend("auto", 2)
    # The data first, once: K lessons starting together must not all generate it at once.
    prep = c.start("data for the lessons", [sys.executable, "-c", "import ddp_helpers.data as d; "
                                            "d.prepare_data()"], 120)
    if prep is not None:
        prep.wait()
    env = dict(c.env)
    if c.workers > 1:  # K lessons at once: each rank gets its share of the cores, not all of them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // (2 * c.workers))))
    queue = [(nb, Step(f"lesson {nb.stem}", f"{device} (auto, 2 ranks)", backend))
             for nb in LESSONS]
    c.steps += [step for _, step in queue]
    running: list[tuple[Step, Proc]] = []
    while queue or running:
        while queue and len(running) < c.workers:
            nb, step = queue.pop(0)
            # -v: the log shows each cell as it passes, so a timeout shows where it stuck
            proc = c.start(step.name, [sys.executable, "-m", "pytest", "--nbval-lax",
                                       "--nbval-current-env", "--nbval-cell-timeout=240",
                                       "-v", "-p", "no:cacheprovider", str(nb)], 300, env)
            if proc is None:
                c.finish(step, None)
            else:
                running.append((step, proc))
        time.sleep(0.5)
        for step, proc in [r for r in running if r[1].poll()]:
            running.remove((step, proc))
            c.finish(step, proc)


def summary(c: Check, need_two: list[str]) -> str:
    """The markdown the run prints and writes to bench/results/gpu.md."""
    gpus = c.facts.get("gpus") or ["GPU (name unknown: the facts step failed)"] * c.gpus
    lines = [f"# gpu-check, {date.today().isoformat()}", "",
             f"{len(gpus)} x {gpus[0]}; torch {c.facts.get('torch', '?')}, CUDA "
             f"{c.facts.get('cuda', '?')}, NCCL {c.facts.get('nccl', '?')}; "
             f"{os.cpu_count()} CPU cores. Command: `make gpu-check` (bench/gpu_check.py).", "",
             "| step | device | backend | result | key figures | seconds |",
             "|---|---|---|---|---|---:|"]
    lines += [f"| {s.name} | {s.device} | {s.backend} | {s.result} | {s.figures} | "
              f"{s.seconds:.0f} |" for s in c.steps]
    if c.gpus < 2:
        lines += ["", "Needs two GPUs, so did not run here: NCCL between two ranks, the MNIST "
                  "run on cuda:0 and cuda:1, bench/allreduce.py's NCCL bus bandwidth and its "
                  "cuda:0 -> cuda:1 link reference, a checkpoint saved on one GPU and loaded "
                  "on the other" + (f"; the tests {', '.join(need_two)}" if need_two else "") +
                  ". One GPU covered: NCCL with one rank, gloo with ranks sharing the GPU "
                  "(device='cuda'), CUDA tensors, pinned memory, CUDA events."]
    lines += ["", f"Logs: {c.logs.relative_to(REPO)}/."]
    return "\n".join(lines) + "\n"


def no_gpu_here() -> int:
    """Say why nothing runs; a GPU torch cannot see is an error, a machine without one is not."""
    smi = shutil.which("nvidia-smi")
    listed = ""
    if smi:
        try:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True,
                                    timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            listed = ""
    if not listed:
        print("no GPU: nothing to check")
        return 0
    import torch

    print(f"nvidia-smi lists GPUs:\n{listed}\nbut torch {torch.__version__} (CUDA "
          f"{torch.version.cuda or 'none: a CPU-only build'}) sees none. Check "
          "CUDA_VISIBLE_DEVICES, and install a CUDA build of torch into this environment "
          "(see pytorch.org/get-started), then run `make gpu-check` again.", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run every step, print and write the summary; the exit status says whether all passed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for everything (default: 450 with one GPU, 870 with two)")
    p.add_argument("--workers", type=int, default=max(1, min(3, (os.cpu_count() or 1) // 4)),
                   help="lessons run at the same time")
    p.add_argument("--facts", help=argparse.SUPPRESS)  # child mode, see facts_and_copies
    a = p.parse_args(argv)
    if a.facts:
        facts_and_copies(a.facts)
        return 0
    gpus = dh.gpu_count()
    if gpus == 0:
        return no_gpu_here()
    # 30 s under the 8- and 15-minute limits: start-up, the summary, a step's last grace period
    c = Check(gpus, a.budget_s or (450 if gpus == 1 else 870), a.workers)
    step_facts(c)
    need_two = step_gpu_tests(c)
    step_mnist(c)
    step_allreduce(c)
    step_lessons(c)
    text = summary(c, need_two)
    RESULTS.write_text(text)
    print("\n" + text + f"\nwritten to {RESULTS.relative_to(REPO)}")
    return 1 if any(s.failed for s in c.steps) else 0


if __name__ == "__main__":
    sys.exit(main())
