"""Persistent ranks: start N ranks once, then run code on them a cell at a time, with each
rank's variables kept between cells (`dh.Ranks`, and the `%%ranks` magics built on it).

The processes, channels, output relay and failure detection are the launcher's
(supervisor.RankSet), and so is the loop that waits (watch.py); what this adds is the
conversation (a protocol.RunCell per cell, a reply per rank) and the rule for a failed cell.
A rank that raised while every other rank finished the cell leaves every rank's state intact.
A rank that raised or died while others wait for it in a collective (or a cell past its
timeout, or an interrupt) stops every rank: their state is gone, the message says where each
rank was, and the next cell starts a fresh group.
"""

from __future__ import annotations

import pickle
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..ledger import Call
from .cell_server import cell_name, serve
from .census import pid_alive
from .errors import (
    CellInterrupted,
    CollectiveMismatch,
    LaunchError,
    LaunchRefused,
    LaunchTimeout,
    RankDied,
    RankRaised,
)
from .live_view import LiveView, display_factory
from .mismatch import aborted_note, explain
from .options import check_cell, check_pool, check_push
from .protocol import Push, Ready, RunCell, Where
from .start import free_port
from .supervisor import Failure, Priority, RankSet
from .tracebacks import shorten_path
from .watch import STALL_SECONDS, CellWatch, Outcome, give_up_once_settled, wait

_current: Ranks | None = None  # the pool `%%ranks` cells and dh.check(...) use

_START_TIMEOUT = 120.0  # a cold start (the start server imports torch) takes a few seconds


class CellResult(NamedTuple):
    """One rank's answer to run(..., returns=names): its last value and the named variables."""

    value: Any
    returned: dict[str, Any]


class Ranks:
    """N persistent ranks that run code cell by cell, each keeping its variables.

    Args:
        nprocs: the number of ranks.
        backend: "auto" (NCCL with a GPU per rank, else gloo on the CPU), "gloo" or "nccl".
        timeout: the default number of seconds one cell may take (also the process group's
            timeout for one collective).
        group: False starts the ranks without a process group, for lessons that call
            dist.init_process_group themselves (MASTER_ADDR/PORT, RANK, WORLD_SIZE are set).
        output: default for run(): "live", "by_rank" (rank 0's lines first; deterministic) or
            "none".
        env: extra environment variables for the ranks.
        start_method: "forkserver" (fast) or "spawn".

    Each rank's namespace starts with rank, world_size, device, torch, dist and nn.
    Use as `with dh.Ranks(2) as pool: ...`, or call pool.stop() when done.

    Raises:
        LaunchRefused: bad arguments, before anything starts.
        RankRaised, RankDied, LaunchTimeout: a rank failed to start.
    """

    def __init__(self, nprocs: int = 2, backend: str = "auto", timeout: float = 60, *,
                 group: bool = True, output: str = "live", env: dict | None = None,
                 start_method: str = "forkserver"):
        self._env = check_pool(nprocs, backend, timeout, output, env, start_method)
        self.nprocs, self.backend, self.timeout = nprocs, backend, timeout
        self.group, self.output, self.start_method = group, output, start_method
        self._set: RankSet | None = None
        self._info: list[Ready] = []
        self.cells_run = 0
        self.labels: dict[str, str] = {}  # "<cell 12>" -> "In [5]": cells the magic named
        self._stopped_because: str | None = None  # why the ranks were stopped, if not by us
        self._finalizer = None
        self.start()

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks (if they are not running) and wait until each has set up."""
        if self._set is not None:
            return
        # The backend reaches the ranks in their environment (options.check_pool), like launch's.
        payload = pickle.dumps((serve, (self.nprocs, self.group, self.timeout)))
        ranks = RankSet(self.nprocs, self.start_method, persistent=True)
        self._set = ranks
        self._finalizer = weakref.finalize(self, ranks.shutdown)
        try:
            ranks.start(payload, self._env, free_port(), self.output)
        except BaseException:
            self._shutdown()
            raise
        self._info = self._request(None, list(range(self.nprocs)), _START_TIMEOUT, self.output,
                                   starting=True)
        self._stopped_because = None
        global _current
        _current = self

    def stop(self) -> None:
        """Stop every rank (their state is gone); a later run() raises until restart()."""
        self._shutdown()
        self._stopped_because = "stopped"

    def restart(self) -> None:
        """Stop the ranks if running and start fresh ones: a new group, empty namespaces."""
        self._shutdown()
        self.start()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True while the ranks are up."""
        return self._set is not None

    # -- running code ---------------------------------------------------------------------------

    def run(self, code: str, targets: list[int] | None = None, timeout: float | None = None,
            output: str | None = None, *, returns: tuple[str, ...] | None = None,
            label: str | None = None, first_line: int = 1) -> list:
        """Run `code` on every rank (or on `targets`) at once; return each rank's value of its
        last expression (None where there is none), in rank order, tensors on the CPU.

        With `returns=("x",)` (any tuple, even empty) each rank's entry is a CellResult
        (last value, {"x": x}) instead: the variables come back in the same round trip.
        `label` names the cell in messages (the magic gives "In [5]"); `first_line` is the
        number of the code's first line (2 below a `%%ranks` line, as the editor counts).

        Raises:
            RankRaised: a rank raised. If every other rank finished the cell, every rank keeps
                its state; if others were stuck waiting for it, all ranks were stopped.
            RankDied: a rank's process died: all ranks were stopped.
            LaunchTimeout: the cell ran past `timeout`: all ranks were stopped.
        """
        timeout = self.timeout if timeout is None else timeout
        output = output or self.output
        targets = check_cell(code, targets, timeout, output, self.nprocs)
        self._ensure_running()
        self.cells_run += 1
        if label:
            self.labels[f"<cell {self.cells_run}>"] = label
        replies = self._request(RunCell(self.cells_run, code, tuple(returns or ()), first_line,
                                        label), targets, timeout, output)
        if returns is None:
            return [reply.value for reply in replies]
        return [CellResult(reply.value, reply.returned) for reply in replies]

    def get(self, name: str, targets: list[int] | None = None) -> list:
        """The variable `name` from every rank (or from `targets`), in rank order."""
        replies = self.run("", targets=targets, returns=(name,), output="none")
        return [reply.returned[name] for reply in replies]

    def push(self, targets: list[int] | None = None, **values) -> None:
        """Set variables on every rank (or on `targets`): push(lr=0.1, steps=5).

        Raises:
            LaunchRefused: a value that cannot be pickled, or one built from a class or function
                defined in the notebook (the ranks cannot import it); nothing is sent.
            RankRaised: a rank could not rebuild a value; every rank keeps its state.
        """
        targets = check_push(values, targets, self.nprocs)
        self._ensure_running()
        self._request(Push(values), targets, self.timeout, self.output)

    def collectives(self) -> dict[int, list[Call]]:
        """The collectives and send/recv calls each rank made in the last cell, in order, as
        the ledger recorded them ({rank: [Call, ...]}; what `%%ranks --ledger` prints)."""
        ledger = getattr(self._set, "ledger", None)
        if ledger is None:
            return {}
        return {r: [call for call, _ in entries] for r, entries in ledger.calls.items()}

    def status(self) -> RanksStatus:
        """Which ranks are alive, their pids, device and backend, and how many cells ran."""
        pids = self._set.pids if self._set else [None] * self.nprocs
        info = self._info or [None] * self.nprocs
        rows = [RankRow(r, pid_alive(pid), pid, ready and ready.device, ready and ready.backend)
                for r, (pid, ready) in enumerate(zip(pids, info))]
        return RanksStatus(self.nprocs, self.running, self.cells_run, rows,
                           self._stopped_because)

    # -- one request ----------------------------------------------------------------------------

    def _request(self, command: RunCell | Push | None, targets: list[int], timeout: float,
                 output: str, *, starting: bool = False) -> list:
        """Send `command` (None: wait for the ranks' Ready) and wait; each target's reply."""
        ranks = self._set
        ranks.relay.last.clear()  # a message quotes what the ranks printed in this cell only
        ranks.ask(targets, command, output)
        watch = CellWatch(ranks, targets)
        view = LiveView(watch, display_factory() if isinstance(command, RunCell) else None)
        deadline = time.monotonic() + timeout
        try:
            if starting:
                outcome = wait(ranks, watch.done, deadline, give_up_once_settled)
            else:
                outcome = wait(ranks, watch.done, deadline, watch.give_up, watch.stalled,
                               view.tick)
        except KeyboardInterrupt:  # the stop button in Jupyter: one sentence, no kit frames
            text = self._drop("the cell was interrupted", watch.where_all(), polite=False)
            raise CellInterrupted(f"ddp_helpers: {text}") from None
        except BaseException:
            self._drop("the cell was interrupted", watch.where_all(), interrupted=True)
            raise
        finally:
            view.close()
        ranks.drain_output()
        ranks.relay.flush()
        if outcome is Outcome.DONE and ranks.failure() is None:
            replies = ranks.replies()
            return [replies[r] for r in targets]
        raise self._failed(outcome, watch, timeout, starting)

    def _failed(self, outcome: Outcome, watch: CellWatch, timeout: float, starting: bool
                ) -> LaunchError:
        ranks = self._set
        failure = ranks.failure()
        if outcome is Outcome.DONE and not starting and not ranks.exitcodes:  # the state stays
            return RankRaised.from_error(
                failure.rank, self.nprocs, failure.error,
                consequence="The other ranks finished the cell; every rank keeps its state.")
        mismatch = self._mismatch(outcome, failure, watch)
        if mismatch is not None:
            return mismatch
        where = watch.where_all()
        last = {r: ranks.relay.last_line(r) for r in range(self.nprocs)}
        consequence = self._drop(_reason(outcome, failure), where)
        if outcome is Outcome.TIMEOUT:
            return LaunchTimeout.from_unfinished(
                watch.unfinished(), self.nprocs, last, what=f" after {timeout:g} s",
                consequence=consequence, in_cell=True)
        if outcome is Outcome.STALLED:
            idle = [r for r in range(self.nprocs) if r not in watch.unfinished()]
            return LaunchTimeout.from_stall(watch.unfinished(), idle, self.nprocs, STALL_SECONDS,
                                            consequence)
        if failure.raised:
            return RankRaised.from_error(failure.rank, self.nprocs, failure.error,
                                         consequence=consequence)
        return RankDied.from_exit(failure.rank, self.nprocs, failure.exitcode,
                                  last.get(failure.rank, ""), consequence=consequence)

    def _mismatch(self, outcome: Outcome, failure: Failure | None, watch: CellWatch,
                  may_be_abort: Priority = Priority.ABORTED) -> CollectiveMismatch | None:
        """A stall, or an abort and its knock-on errors, that the ledgers explain. A failure
        below `may_be_abort` (a rank's own error, a death by another signal) is its own cause."""
        if outcome is not Outcome.STALLED and (
                failure is None or failure.priority < may_be_abort):
            return None  # a rank's own error or death is the cause, not a mismatch
        self._set.drain_output()  # the ledger lines still in the pipes
        finding = watch.mismatch()
        if finding is None:
            return None
        text = explain(finding, self.nprocs, self.place, time.monotonic())
        text += aborted_note(self._set.exitcodes)
        consequence = self._drop("the collectives did not match", {}, polite=False)
        return CollectiveMismatch.from_finding(finding, text, watch.unfinished(), consequence)

    def place(self, where: tuple[str, int]) -> str:
        """A call's place as the learner sees it: "In [5], line 4"."""
        path, line = where
        if path.startswith("<cell "):
            return f"{cell_name(path, self.labels)}, line {line}"
        return f"{shorten_path(path)}, line {line}"

    def _drop(self, reason: str, where: dict[int, Where | None], *,
              interrupted: bool = False, polite: bool = True) -> str:
        """Stop every rank after a failure; return the sentence that says so."""
        self._shutdown(polite=polite)
        self._stopped_because = reason
        text = (f"Every rank was stopped ({reason}){_where_text(where)}. Their variables are "
                "gone; the next cell starts a fresh group.")
        if interrupted:
            print(f"ddp_helpers: {text}", flush=True)
        return text

    def _shutdown(self, *, polite: bool = True) -> None:
        if self._set is not None:
            self._finalizer.detach()
            self._set.shutdown(polite=polite)
        self._set = None

    def _ensure_running(self) -> None:
        if self._set is not None:
            return
        if self._stopped_because == "stopped":
            raise LaunchRefused(f"these ranks were stopped: start fresh ones with "
                                f"{start_command(self)} (in Python: pool.restart()).")
        print(f"starting {self.nprocs} fresh ranks (the previous ones were stopped: "
              f"{self._stopped_because})", flush=True)
        self.start()

    # -- ranks that torchrun or Slurm started (served.py) ---------------------------------------

    @classmethod
    def listen(cls, nprocs: int = 2, host: str = "127.0.0.1", port: int = 0,
               timeout: float = 60, **options) -> Ranks:
        """A pool of `nprocs` ranks that torchrun (or srun) starts with `python -m
        ddp_helpers.serve --connect pool.address --token-file pool.token_file`; not ready until
        `pool.wait_ready(seconds)` (or the first run()). Listens on loopback unless `host`
        says otherwise. Then run/get/push/status/stop work as for `Ranks(...)`."""
        from .served import ServedRanks

        return ServedRanks(nprocs, host, port, timeout, **options)


def current() -> Ranks | None:
    """The pool started last (by `%ranks start` or `dh.Ranks(...)`), running or not."""
    return _current


def start_command(pool: Ranks | None = None) -> str:
    """The magic that brings the ranks back, sized as the last pool was: `%ranks start 3`
    (the one command every message gives, whether the ranks were stopped or never started)."""
    pool = pool or _current
    return f"`%ranks start {pool.nprocs if pool is not None else 2}`"


def _reason(outcome: Outcome, failure: Failure | None) -> str:
    if outcome is Outcome.TIMEOUT:
        return "the cell ran past its timeout"
    if outcome is Outcome.STALLED:
        return "a collective could not complete"
    if failure is not None and not failure.raised:
        return f"rank {failure.rank} died, and a group cannot go on without a rank"
    return (f"rank {failure.rank} failed while the others waited for it"
            if failure is not None else "a rank failed")


def _where_text(where: dict[int, Where | None]) -> str:
    parts = []
    for rank, info in sorted(where.items()):
        if info is None:
            parts.append(f"rank {rank} did not answer (blocked in C++ code)")
        elif info.exited:
            parts.append(f"rank {rank} had exited")
        elif info.cell:
            call = f"in {info.call}, " if info.call else ""
            parts.append(f"rank {rank} was {call}at {info.cell}")
    return "; " + "; ".join(parts) if parts else ""


@dataclass
class RankRow:
    """One rank in a status report."""

    rank: int
    alive: bool
    pid: int | None
    device: str | None
    backend: str | None


@dataclass
class RanksStatus:
    """What `Ranks.status()` returns; prints as a short table."""

    nprocs: int
    running: bool
    cells_run: int
    ranks: list[RankRow] = field(default_factory=list)
    stopped_because: str | None = None

    def __str__(self) -> str:
        if not self.running:
            return f"{self.nprocs} ranks, not running ({self.stopped_because or 'stopped'})"
        head = f"{self.nprocs} ranks running, {self.cells_run} cells run"
        rows = [f"  rank {r.rank}: {'alive' if r.alive else 'DEAD'}, pid {r.pid}, device "
                f"{r.device}, backend {r.backend or 'none (no process group)'}"
                for r in self.ranks]
        return "\n".join([head, *rows])

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))
