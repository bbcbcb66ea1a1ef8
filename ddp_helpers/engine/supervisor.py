"""Parent side of every run, one-shot (`launch`) or persistent (`Ranks`): start the rank
processes, relay their output, collect their reports, notice failures, and stop them all.

Ranks start through torch.multiprocessing.start_processes (torch's own process context, its
`_wrap` with parent-death signal and error file) on a forkserver whose interpreter preloads torch
but never the learner's modules and never CUDA: a warm start costs a fork, not a Python + torch
start-up. Supervision is our own: torch's ProcessContext.join gives failing runs a SIGTERM and up
to 30 s of grace, while a rank blocked in a collective must be stopped at once, and output must
be relayed meanwhile. This module observes; errors.py words what it observed.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.multiprocessing as tmp

from .errors import looks_like_peer_failure
from .rank_entry import RankSpec, rank_entry
from .relay import OutputRelay

_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data",
            "numpy", "torchvision", "ddp_helpers.engine.rank_entry",
            "ddp_helpers.engine.cell_server"]
DRAIN_SECONDS = 1.0  # how long output from finished ranks may keep arriving (their workers)
SETTLE_SECONDS = 0.5  # a rank whose peer died errors first; its root cause arrives within this
_POLL_SECONDS = 0.25  # the longest the loop sleeps before re-checking deadlines


class Priority(enum.IntEnum):
    """Which failure to report when several ranks failed: the lowest value wins."""

    ROOT_CAUSE = 0  # a rank raised an error of its own
    DIED = 1  # a rank exited without a report: a signal, os._exit
    ABORTED = 2  # a rank died of SIGABRT: gloo aborts a rank whose peer vanished
    KNOCK_ON = 3  # a rank raised because a peer failed first (connection closed, timed out)


@dataclass(frozen=True)
class Failure:
    """The failure to report: which rank, and whether it raised or died."""

    priority: Priority
    rank: int
    raised: bool  # True: its report is in RankSet.reports; False: its exit code is in .exitcodes


class RankSet:
    """The processes of one run: their pipes, what they reported and how they exited.

    `persistent=True` gives every rank a command pipe and a control pipe (for `Ranks`), and makes
    any exit a death, since persistent ranks only exit when told to.
    """

    def __init__(self, nprocs: int, output: str, start_method: str, *,
                 persistent: bool = False):
        self.nprocs = nprocs
        self.start_method = start_method
        self.persistent = persistent
        self.ctx = multiprocessing.get_context(start_method)
        self.relay = OutputRelay(nprocs, output)
        self.reports: dict[int, tuple] = {}  # rank -> ("ok", value) or ("error", type, msg, tb)
        self.exitcodes: dict[int, int] = {}
        self.ends: dict = {}  # our read ends -> (kind, rank)
        self.commands: dict[int, object] = {}
        self.controls: dict[int, object] = {}
        self.context = None
        self.stopped = False
        self._lifeline = None
        self._waiting: dict = {}  # process sentinel -> rank, for ranks not yet exited
        self._closed: set[int] = set()  # ranks whose Process object was closed after reaping
        self._stack_ends: dict[int, object] = {}  # rank -> read end of its faulthandler pipe

    # -- starting -------------------------------------------------------------------------------

    def start(self, payload: bytes, env: dict) -> None:
        """Start every rank on `payload` (a pickled (fn, args)) with `env` as its environment."""
        _prepare_start_server(self.start_method)
        specs = self._pipes(payload, env)
        with inherited_env(env if self.start_method == "spawn" else None):
            self.context = tmp.start_processes(rank_entry, args=(specs,), nprocs=self.nprocs,
                                               join=False, start_method=self.start_method)
        for spec in specs:  # the ranks hold these now; our copies would hide EOF
            for conn in spec.child_ends():
                conn.close()
        self._waiting = {p.sentinel: r for r, p in enumerate(self.context.processes)}

    def _pipes(self, payload: bytes, env: dict) -> list[RankSpec]:
        lifeline_r, self._lifeline = self.ctx.Pipe(duplex=False)
        specs = []
        for rank in range(self.nprocs):
            out_r, out_w = self.ctx.Pipe(duplex=False)
            err_r, err_w = self.ctx.Pipe(duplex=False)
            res_r, res_w = self.ctx.Pipe(duplex=False)
            stk_r, stk_w = self.ctx.Pipe(duplex=False)
            self.ends.update({out_r: ("out", rank), err_r: ("err", rank), res_r: ("res", rank)})
            self._stack_ends[rank] = stk_r
            cmd_r = control_child = None
            if self.persistent:
                cmd_r, self.commands[rank] = self.ctx.Pipe(duplex=False)
                self.controls[rank], control_child = self.ctx.Pipe(duplex=True)
            specs.append(RankSpec(payload=payload, env=env, sys_path=list(sys.path),
                                  cwd=os.getcwd(),
                                  start_method=multiprocessing.get_start_method(allow_none=True),
                                  out=out_w, err=err_w, result=res_w, lifeline=lifeline_r,
                                  stacks=stk_w, commands=cmd_r, control=control_child))
        return specs

    @property
    def pids(self) -> list[int | None]:
        """Each rank's process id (None before start and once reaped)."""
        procs = dict(self._open_processes())
        return [procs[r].pid if r in procs else None for r in range(self.nprocs)]

    # -- waiting --------------------------------------------------------------------------------

    def wait(self, done: Callable[[], bool], deadline: float,
             give_up: Callable[[Failure, bool], bool],
             stalled: Callable[[], bool] | None = None) -> str:
        """Relay output and collect reports until `done()` ("done"), the deadline ("timeout"),
        a failure that `give_up(failure, settled)` accepts ("failed"), or, without any failure,
        until `stalled()` says the ranks can make no progress ("stalled"). `settled` turns True
        SETTLE_SECONDS after the first failure, when a root cause has had time to arrive."""
        settle_at = None
        while not done():
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            settling = settle_at if settle_at and settle_at > now else deadline
            wake = min(deadline, settling, now + _POLL_SECONDS)
            ready = multiprocessing.connection.wait(list(self.ends) + list(self._waiting),
                                                    max(wake - now, 0))
            self._handle(ready)
            failure = self.first_failure()
            if failure is not None:
                settle_at = settle_at or time.monotonic() + SETTLE_SECONDS
                if give_up(failure, time.monotonic() >= settle_at):
                    return "failed"
            elif stalled is not None and stalled():
                return "stalled"
        return "done"

    def _handle(self, ready: list) -> None:
        for conn in [o for o in ready if o in self.ends]:
            self._read(conn)
        for sentinel in [o for o in ready if o in self._waiting]:
            rank = self._waiting.pop(sentinel)
            proc = self.context.processes[rank]
            proc.join()
            self.exitcodes[rank] = proc.exitcode
            self._drain_reports(rank)

    def _read(self, conn) -> None:
        kind, rank = self.ends[conn]
        if kind == "res":
            self._read_report(conn, rank)
        else:
            self._read_output(conn, rank, kind)

    def _read_report(self, conn, rank: int) -> None:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._forget(conn)
            return
        except Exception as e:  # noqa: BLE001 - e.g. a class defined in a %%ranks cell
            message = ("error", "UnpicklingError",
                       f"the rank's result could not be rebuilt in this process: "
                       f"{type(e).__name__}: {e}. Return plain data (numbers, strings, lists, "
                       "dicts, tensors) instead of objects of classes defined on the ranks.", "")
        if message[0] == "ok" or rank not in self.reports:
            self.reports[rank] = message

    def _read_output(self, conn, rank: int, kind: str) -> None:
        try:
            data = os.read(conn.fileno(), 65536)
        except OSError:
            data = b""
        if data:
            self.relay.feed(rank, kind, data)
        else:
            self._forget(conn)

    def _forget(self, conn) -> None:
        del self.ends[conn]
        conn.close()

    def _drain_reports(self, rank: int) -> None:
        for conn, (kind, r) in list(self.ends.items()):
            if r == rank and kind == "res":
                while conn in self.ends and conn.poll(0):
                    self._read(conn)

    def drain_output(self, seconds: float = 0.0) -> None:
        """Relay what is already in the output pipes; with `seconds`, also what arrives within
        that grace (output of finished ranks' workers)."""
        deadline = time.monotonic() + seconds
        while True:
            outputs = [c for c, (kind, _) in self.ends.items() if kind != "res"]
            ready = multiprocessing.connection.wait(
                outputs, max(deadline - time.monotonic(), 0)) if outputs else []
            if not ready:
                return
            for conn in ready:
                self._read(conn)

    def first_failure(self) -> Failure | None:
        """The root cause among the failures seen so far, or None."""
        candidates = []
        for rank, report in self.reports.items():
            if report[0] == "error":
                knock_on = looks_like_peer_failure(report[1], report[2])
                candidates.append(Failure(Priority.KNOCK_ON if knock_on else Priority.ROOT_CAUSE,
                                          rank, True))
        for rank, code in self.exitcodes.items():
            if rank not in self.reports or self.persistent or code != 0:
                if self.reports.get(rank, ("",))[0] != "error":
                    # gloo aborts a rank whose peer vanished mid-collective: a SIGABRT is most
                    # often a consequence, so a peer's SIGKILL or segfault is reported first.
                    aborted = code == -signal.SIGABRT
                    candidates.append(Failure(Priority.ABORTED if aborted else Priority.DIED,
                                              rank, False))
        return min(candidates, key=lambda f: (f.priority, f.rank)) if candidates else None

    def all_exited(self) -> bool:
        """True once every rank process has exited."""
        return not self._waiting

    def alive(self, rank: int) -> bool:
        """True while rank's process has not exited."""
        return rank not in self.exitcodes and not self.stopped

    # -- persistent ranks -----------------------------------------------------------------------

    def send(self, rank: int, message: tuple) -> bool:
        """Send a command to a persistent rank; False if its pipe is gone (the rank died)."""
        try:
            self.commands[rank].send_bytes(pickle.dumps(message))
            return True
        except (OSError, ValueError):
            return False

    def where(self, rank: int, timeout: float = 0.3) -> dict | None:
        """Ask a persistent rank's control thread where its main thread is, or None if it does
        not answer in time (dead, or blocked in C++ code that holds the GIL)."""
        conn = self.controls.get(rank)
        if conn is None or not self.alive(rank):
            return None
        try:
            while conn.poll(0):  # a late answer to an earlier question
                conn.recv()
            conn.send("where")
            return conn.recv() if conn.poll(timeout) else None
        except (OSError, EOFError, ValueError):
            return None

    def dump_stacks(self, ranks: list[int], seconds: float = 1.0) -> dict[int, str]:
        """Ask each rank's faulthandler for every thread's Python stack (SIGUSR1); return the
        raw text per rank, for a hung run's error. Ranks that do not answer get ""."""
        for r in ranks:
            pid = self.pids[r]
            if pid is not None and self.alive(r):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        texts = {r: b"" for r in ranks}
        pending = {self._stack_ends[r]: r for r in ranks if r in self._stack_ends}
        deadline = time.monotonic() + seconds
        while pending and time.monotonic() < deadline:
            # Once every rank has written something, a quiet 0.1 s means the dumps are complete.
            quiet = 0.1 if all(texts.values()) else deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(pending), max(quiet, 0))
            if not ready and all(texts.values()):
                break
            for conn in ready:
                chunk = _read_chunk(conn)
                texts[pending[conn]] += chunk
                if not chunk:  # EOF: the rank is gone
                    del pending[conn]
        return {r: t.decode("utf-8", "replace") for r, t in texts.items()}

    # -- stopping -------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGKILL every rank's process group (the rank and its workers); reap the ranks."""
        if self.context is None or self.stopped:
            return
        self.stopped = True
        for _, p in self._open_processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # rank_entry made pid its process-group id
            if p.is_alive():  # killed before setsid ran: its group was still ours
                p.kill()
        self.reap(5)

    def reap(self, seconds: float) -> None:
        """Wait up to `seconds` for the ranks to exit, recording exit codes; free their fds."""
        deadline = time.monotonic() + seconds
        for rank, p in self._open_processes():
            p.join(max(deadline - time.monotonic(), 0))
            if p.exitcode is not None:
                if not self.stopped:  # ranks we killed did not fail: keep them out of reports
                    self.exitcodes.setdefault(rank, p.exitcode)
                self._waiting.pop(p.sentinel, None)
                self._closed.add(rank)
                p.close()  # release its sentinel fd now, not whenever the GC gets to it

    def _open_processes(self) -> list:
        if self.context is None:
            return []
        return [(r, p) for r, p in enumerate(self.context.processes) if r not in self._closed]

    def close(self) -> None:
        """Close every pipe we hold (after stop) and remove torch's error files."""
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        for conn in [*self.ends, *self.commands.values(), *self.controls.values(),
                     *self._stack_ends.values()]:
            with contextlib.suppress(OSError):
                conn.close()
        self.ends.clear()
        self.commands.clear()
        self.controls.clear()
        self._stack_ends.clear()
        for path in getattr(self.context, "error_files", []) or []:
            with contextlib.suppress(FileNotFoundError, TypeError):
                os.unlink(path)

    def close_lifeline(self) -> None:
        """Tell the ranks the parent is done with them: each then kills its process group."""
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None


def _read_chunk(conn) -> bytes:
    try:
        return os.read(conn.fileno(), 65536)
    except OSError:
        return b""


def _prepare_start_server(start_method: str) -> None:
    if start_method == "forkserver":
        present = [m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0])]
        multiprocessing.get_context("forkserver").set_forkserver_preload(present)


@contextlib.contextmanager
def inherited_env(env: dict | None):
    """Set `env` as os.environ for the block, then restore the caller's environment exactly.

    With spawn, each rank's interpreter imports torch before rank_entry runs, so variables torch
    reads at import (TORCH_CPP_LOG_LEVEL) must be in the environment it is started with."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
