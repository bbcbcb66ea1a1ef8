"""The launcher's fault campaign: each fault once, with what the user sees, seconds from fault to
error, processes left behind and whether the next launch works. tests/test_faults.py asserts on
the same cases; `python -m bench.fault_campaign` prints the table the README quotes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ddp_helpers as dh
from bench import fault_fns
from bench.common import write_table
from ddp_helpers.engine import wait_for_no_descendants

TWO_LAUNCHES = """
import ddp_helpers as dh
from bench import fault_fns
for _ in range(5):
    assert dh.launch(fault_fns.ok, args=(2,), nprocs=2, timeout=60, output="none") == [2.0, 2.0]
print("ok")
"""


@dataclass
class Case:
    name: str
    expect: type[BaseException]
    match: str
    fn: Callable | None = None
    timeout: float = 60
    run: Callable[[Case, str], BaseException | None] | None = None  # custom instead of a launch
    extra: dict = field(default_factory=dict)


@dataclass
class Outcome:
    case: Case
    error: BaseException | None
    seconds: float | None
    left: int
    next_ok: bool

    @property
    def headline(self) -> str:
        if self.error is None:
            return "(no error: both processes' launches succeeded)"
        first = (str(self.error).splitlines() or [""])[0]
        return first or type(self.error).__name__


def _launch(case: Case, mark: str) -> BaseException | None:
    try:
        dh.launch(case.fn, args=(2, mark), nprocs=2, timeout=case.timeout, output="none")
    except BaseException as e:  # noqa: BLE001 - the campaign records whatever comes out
        return e
    return None


def _kill_from_outside(case: Case, mark: str) -> BaseException | None:
    threading.Thread(target=fault_fns.kill_from_outside, args=(mark,), daemon=True).start()
    return _launch(case, mark)


def _interrupt(case: Case, mark: str) -> BaseException | None:
    main = threading.main_thread().ident

    def interrupt_when_running() -> None:
        while not Path(mark).exists():
            time.sleep(0.05)
        time.sleep(0.5)
        fault_fns._stamp(mark)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    return _launch(case, mark)


def _port_taken(case: Case, mark: str) -> BaseException | None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        fault_fns._stamp(mark)
        try:
            dh.launch(fault_fns.ok, args=(2,), nprocs=2, timeout=30, output="none",
                      master_port=holder.getsockname()[1])
        except BaseException as e:  # noqa: BLE001
            return e
    return None


def _two_at_once(case: Case, mark: str) -> BaseException | None:
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", TWO_LAUNCHES], cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:  # a hung launch: stop it and its ranks
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if any(p.returncode != 0 or "ok" not in out for p, out in zip(procs, outs)):
        return RuntimeError("a concurrent launch failed:\n" + "\n".join(outs))
    return None


CASES = [
    Case("rank raises before init", dh.RankRaised,
         r"rank 1 of 2 raised ValueError: bad config", fault_fns.raise_before_init),
    Case("rank raises after init", dh.RankRaised,
         r"rank 1 of 2 raised RuntimeError: loss is NaN", fault_fns.raise_after_init),
    Case("rank raises inside a collective", dh.RankRaised, r"rank 1 of 2 raised",
         fault_fns.raise_inside_collective),
    Case("rank calls os._exit(3)", dh.RankDied, r"rank 1 of 2 exited with code 3",
         fault_fns.exit_three),
    Case("rank SIGKILLed from outside mid all-reduce", dh.RankDied,
         r"rank 1 of 2 was killed by signal SIGKILL", fault_fns.all_reduce_forever,
         run=_kill_from_outside),
    Case("rank segfaults (ctypes)", dh.RankDied, r"rank 1 of 2 was killed by signal SIGSEGV",
         fault_fns.segfault),
    Case("one rank skips a collective (desync)", dh.LaunchError,
         r"rank 0 is in all_reduce #1 .*rank 1 is in monitored_barrier #1|rank [01] of 2",
         fault_fns.skip_a_collective, timeout=30),
    Case("one rank never calls init_process_group", dh.RankRaised,
         r"rank 0 of 2 raised .*(1/2 clients joined|[Tt]imed out)", fault_fns.never_init),
    Case("KeyboardInterrupt in the caller", KeyboardInterrupt, "", fault_fns.sleep_forever,
         run=_interrupt),
    Case("timeout while ranks wait on DataLoader workers", dh.LaunchTimeout,
         r"rank\(s\) 0, 1 of 2 had not finished", fault_fns.stuck_in_dataloader, timeout=8),
    Case("MASTER_PORT already taken", dh.LaunchRefused, r"already in use", run=_port_taken),
    Case("two launches at once from two processes", type(None), "", run=_two_at_once),
]


def run_case(case: Case) -> Outcome:
    """Run one fault; measure the error, time from fault to error, leftovers, the next launch."""
    with tempfile.TemporaryDirectory() as tmp:
        mark = str(Path(tmp) / "fault-time")
        error = (case.run or _launch)(case, mark)
        raised_at = time.time()
        seconds = raised_at - float(Path(mark).read_text()) if Path(mark).exists() else None
    left = len(wait_for_no_descendants())
    try:
        next_ok = dh.launch(fault_fns.ok, args=(2,), nprocs=2, timeout=60,
                            output="none") == [2.0, 2.0]
    except dh.LaunchError:
        next_ok = False
    return Outcome(case, error, seconds, left, next_ok)


def main() -> list[Outcome]:
    """Run every case and write bench/results/faults.md."""
    outcomes = [run_case(c) for c in CASES]
    rows = [[o.case.name, "`" + o.headline.replace("|", "/")[:110] + "`",
             "-" if o.seconds is None else f"{o.seconds:.2f} s", str(o.left),
             "yes" if o.next_ok else "NO"] for o in outcomes]
    write_table("faults", ["fault", "what the user sees (first line)", "fault to error",
                           "processes left", "next launch works"], rows)
    return outcomes


if __name__ == "__main__":
    main()
