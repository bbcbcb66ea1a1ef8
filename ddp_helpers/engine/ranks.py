"""Persistent ranks: start N ranks once, then run code on them a cell at a time, with each
rank's variables kept between cells (`dh.Ranks`, and the `%%ranks` magics built on it).

The processes, pipes, output relay and failure detection are the launcher's (supervisor.RankSet);
what this adds is the conversation: a command per cell, a report per rank, and the rule for a
failed cell. A rank that raised while every other rank finished the cell leaves every rank's
state intact. A rank that raised or died while others wait for it in a collective (or a cell
past its timeout, or an interrupt) stops every rank: their state is gone, the message says where
each rank was, and the next cell starts a fresh group.
"""

from __future__ import annotations

import os
import pickle
import time
import weakref
from dataclasses import dataclass, field

import psutil

from .cell_server import serve
from .census import pid_alive
from .errors import LaunchError, LaunchRefused, LaunchTimeout, RankDied, RankRaised
from .launch import free_port
from .options import (
    check_backend,
    check_env,
    check_output,
    check_run_options,
    check_sendable,
    check_timeout,
)
from .supervisor import Failure, Priority, RankSet

_current: Ranks | None = None  # the pool `%%ranks` cells and dh.check(...) use

STALL_SECONDS = 3.0  # a rank waiting this long in a collective that cannot complete is stuck
_START_TIMEOUT = 120.0  # a cold start (the start server imports torch) takes a few seconds


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
        self._env = check_options(nprocs, backend, timeout, output, env, start_method)
        self.nprocs, self.backend, self.timeout = nprocs, backend, timeout
        self.group, self.output, self.start_method = group, output, start_method
        self._set: RankSet | None = None
        self._info: list[dict] = []
        self.cells_run = 0
        self._stopped_because: str | None = None  # why the ranks were stopped, if not by us
        self._finalizer = None
        self.start()

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks (if they are not running) and wait until each has set up."""
        if self._set is not None:
            return
        payload = pickle.dumps((serve, (self.nprocs, self.group, self.backend, self.timeout)))
        env = {**os.environ, **self._env, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(self.nprocs),
               "LOCAL_WORLD_SIZE": str(self.nprocs)}
        ranks = RankSet(self.nprocs, self.output, self.start_method, persistent=True)
        self._set = ranks
        self._finalizer = weakref.finalize(self, _shut, ranks)
        try:
            ranks.start(payload, env)
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
            output: str | None = None, *, returns: tuple[str, ...] | None = None) -> list:
        """Run `code` on every rank (or on `targets`) at once; return each rank's value of its
        last expression (None where there is none), in rank order, tensors on the CPU.

        With `returns=("x",)` (any tuple, even empty) each rank's entry is
        (last value, {"x": x}) instead: the variables come back in the same round trip.

        Raises:
            RankRaised: a rank raised. If every other rank finished the cell, every rank keeps
                its state; if others were stuck waiting for it, all ranks were stopped.
            RankDied: a rank's process died: all ranks were stopped.
            LaunchTimeout: the cell ran past `timeout`: all ranks were stopped.
        """
        if not isinstance(code, str):
            raise LaunchRefused(f"code must be a string of Python (got {type(code).__name__}).")
        targets = self._check_targets(targets)
        timeout = self.timeout if timeout is None else timeout
        check_timeout(timeout)
        check_output(output or self.output)
        self._ensure_running()
        self.cells_run += 1
        replies = self._request(("run", self.cells_run, code, list(returns or ())), targets,
                                timeout, output or self.output)
        return replies if returns is not None else [value for value, _ in replies]

    def get(self, name: str, targets: list[int] | None = None) -> list:
        """The variable `name` from every rank (or from `targets`), in rank order."""
        replies = self.run("", targets=targets, returns=(name,), output="none")
        return [named[name] for _, named in replies]

    def push(self, targets: list[int] | None = None, **values) -> None:
        """Set variables on every rank (or on `targets`): push(lr=0.1, steps=5).

        Raises:
            LaunchRefused: a value that cannot be pickled, or one built from a class or function
                defined in the notebook (the ranks cannot import it); nothing is sent.
            RankRaised: a rank could not rebuild a value; every rank keeps its state.
        """
        targets = self._check_targets(targets)
        for name, value in values.items():
            check_sendable(value, f"push: {name} (a {type(value).__name__})",
                           plain_fix="Push plain data (numbers, strings, lists, dicts, CPU "
                                     "tensors). Nothing was sent.",
                           main_fix="Define it in a %%ranks cell and build the value there, or "
                                    "push plain data. Nothing was sent.")
        self._ensure_running()
        self._request(("push", values), targets, self.timeout, self.output)

    def status(self) -> RanksStatus:
        """Which ranks are alive, their pids, device and backend, and how many cells ran."""
        pids = self._set.pids if self._set else [None] * self.nprocs
        rows = [RankRow(r, pid_alive(pid), pid, info.get("device"), info.get("backend"))
                for r, (pid, info) in enumerate(zip(pids, self._info or [{}] * self.nprocs))]
        return RanksStatus(self.nprocs, self.running, self.cells_run, rows,
                           self._stopped_because)

    # -- one request ----------------------------------------------------------------------------

    def _request(self, message, targets: list[int], timeout: float, output: str, *,
                 starting: bool = False) -> list:
        ranks = self._set
        ranks.relay.mode = output
        ranks.reports.clear()
        if message is not None:
            for r in targets:
                ranks.send(r, message)  # a dead rank shows up as its sentinel in wait()
        watch = _Watch(ranks, targets)
        try:
            outcome = ranks.wait(watch.done, time.monotonic() + timeout,
                                 _starting_give_up if starting else watch.give_up,
                                 stalled=None if starting else watch.stalled)
        except BaseException:  # KeyboardInterrupt: the stop button in Jupyter
            self._drop("the cell was interrupted", watch.where_all(), interrupted=True)
            raise
        ranks.drain_output()
        ranks.relay.flush()
        if outcome == "done" and ranks.first_failure() is None:
            return [ranks.reports[r][1] for r in targets]
        raise self._failed(outcome, watch, timeout, starting)

    def _failed(self, outcome: str, watch: _Watch, timeout: float, starting: bool
                ) -> LaunchError:
        ranks = self._set
        failure = ranks.first_failure()
        if outcome == "done" and not starting and not ranks.exitcodes:  # the state stays
            return RankRaised.from_report(
                failure.rank, self.nprocs, ranks.reports[failure.rank][1:],
                consequence="The other ranks finished the cell; every rank keeps its state.")
        where = watch.where_all()
        last = {r: ranks.relay.last_line(r) for r in range(self.nprocs)}
        consequence = self._drop(_reason(outcome, failure), where)
        if outcome == "timeout":
            return LaunchTimeout.from_unfinished(
                watch.unfinished(), self.nprocs, last, what=f" after {timeout:g} s",
                consequence=consequence)
        if outcome == "stalled":
            idle = [r for r in range(self.nprocs) if r not in watch.unfinished()]
            return LaunchTimeout.from_stall(watch.unfinished(), idle, self.nprocs, STALL_SECONDS,
                                            consequence)
        if failure.raised:
            return RankRaised.from_report(failure.rank, self.nprocs,
                                          ranks.reports[failure.rank][1:],
                                          consequence=consequence)
        return RankDied.from_exit(failure.rank, self.nprocs, ranks.exitcodes[failure.rank],
                                  last.get(failure.rank, ""), consequence=consequence)

    def _drop(self, reason: str, where: dict[int, dict | None], *,
              interrupted: bool = False) -> str:
        """Stop every rank after a failure; return the sentence that says so."""
        self._shutdown()
        self._stopped_because = reason
        text = (f"Every rank was stopped ({reason}){_where_text(where)}. Their variables are "
                "gone; the next cell starts a fresh group.")
        if interrupted:
            print(f"ddp_helpers: {text}", flush=True)
        return text

    def _shutdown(self) -> None:
        if self._set is not None:
            _shut(self._set)
            self._finalizer.detach()
        self._set = None

    def _ensure_running(self) -> None:
        if self._set is not None:
            return
        if self._stopped_because == "stopped":
            raise LaunchRefused("these ranks were stopped: call .restart() (or `%ranks restart`) "
                                "to start fresh ones.")
        print(f"starting {self.nprocs} fresh ranks (the previous ones were stopped: "
              f"{self._stopped_because})", flush=True)
        self.start()

    def _check_targets(self, targets) -> list[int]:
        if targets is None:
            return list(range(self.nprocs))
        if isinstance(targets, int):
            targets = [targets]
        bad = [t for t in targets if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.nprocs]
        if bad or not targets:
            raise LaunchRefused(f"targets={targets!r}: give ranks from 0 to {self.nprocs - 1}, "
                                "e.g. targets=[0] (or --targets 0,1). Nothing was run.")
        return sorted(set(targets))


def check_options(nprocs, backend, timeout, output, env, start_method="forkserver") -> dict:
    """Every refusal Ranks(...) makes before starting anything (LaunchRefused); returns the
    ranks' extra environment."""
    check_run_options(nprocs, timeout, start_method, output)
    if timeout == float("inf"):
        raise LaunchRefused("timeout=inf: the ranks' process group needs a finite timeout for "
                            "one collective; give seconds, e.g. timeout=3600. Nothing was "
                            "started.")
    return {**check_env(env), **check_backend(backend, nprocs)}


def current() -> Ranks | None:
    """The pool started last (by `%ranks start` or `dh.Ranks(...)`), running or not."""
    return _current


class _Watch:
    """One request's view of the ranks: who answered, and who is stuck where."""

    def __init__(self, ranks: RankSet, targets: list[int]):
        self.ranks, self.targets = ranks, targets
        self.started = time.monotonic()
        self.seen: dict[int, dict | None] = {}
        self._cpu: dict[int, tuple[float, float]] = {}

    def unfinished(self) -> list[int]:
        return [r for r in self.targets if r not in self.ranks.reports]

    def done(self) -> bool:
        return all(r in self.ranks.reports for r in self.targets)

    def give_up(self, failure: Failure, settled: bool) -> bool:
        """Stop at once for a dead rank; after the settle, once every unfinished rank is
        blocked waiting for its peers (it would never finish the cell)."""
        if failure.priority == Priority.DIED:
            return True
        return settled and all(self.blocked(r) for r in self.unfinished())

    def stalled(self) -> bool:
        """Some rank finished (or was not asked) while the others have waited STALL_SECONDS in
        communication: a collective needs every rank of its group, so it cannot complete."""
        if time.monotonic() - self.started < STALL_SECONDS:
            return False
        left = self.unfinished()
        if not left or len(left) == self.ranks.nprocs:
            return False
        return all(self.blocked(r) for r in left)

    def blocked(self, rank: int) -> bool:
        """In communication (a torch.distributed frame, or no answer: blocked in C++) and not
        using the CPU since the last look, i.e. waiting for a peer, not moving data."""
        info = self.ranks.where(rank)
        self.seen[rank] = info
        busy = self._cpu_busy(rank)
        return (info is None or info["in_comm"]) and busy is False

    def _cpu_busy(self, rank: int) -> bool | None:
        """Did the rank use more than 5% of a core since the last look? None at the first."""
        pid = self.ranks.pids[rank]
        try:
            cpu = sum(psutil.Process(pid).cpu_times()[:2])
        except (psutil.Error, TypeError):
            return False
        now = time.monotonic()
        before = self._cpu.get(rank)
        if before is not None and now - before[0] < 0.2:
            return None  # too soon to tell: keep the older sample
        self._cpu[rank] = (now, cpu)
        if before is None:
            return None
        return (cpu - before[1]) / (now - before[0]) > 0.05

    def where_all(self) -> dict[int, dict | None]:
        for r in self.unfinished():
            if not self.ranks.alive(r):
                self.seen[r] = {"exited": True}
            elif r not in self.seen:
                self.seen[r] = self.ranks.where(r)
        return {r: self.seen.get(r) for r in self.unfinished()}


def _starting_give_up(failure: Failure, settled: bool) -> bool:
    # While the ranks set up, any failure ends the start (a knock-on one after the settle).
    return failure.priority < Priority.ABORTED or settled


def _reason(outcome: str, failure: Failure | None) -> str:
    if outcome == "timeout":
        return "the cell ran past its timeout"
    if outcome == "stalled":
        return "a collective could not complete"
    if failure is not None and not failure.raised:
        return f"rank {failure.rank} died, and a group cannot go on without a rank"
    return (f"rank {failure.rank} failed while the others waited for it"
            if failure is not None else "a rank failed")


def _where_text(where: dict[int, dict | None]) -> str:
    parts = []
    for rank, info in sorted(where.items()):
        if info is None:
            parts.append(f"rank {rank} did not answer (blocked in C++ code)")
        elif info.get("exited"):
            parts.append(f"rank {rank} had exited")
        elif info.get("cell"):
            call = f"in {info['call']}, " if info.get("call") else ""
            parts.append(f"rank {rank} was {call}at {info['cell']}")
    return "; " + "; ".join(parts) if parts else ""


def _shut(ranks: RankSet) -> None:
    """Ask the ranks to leave (destroying their groups), then stop whatever is left."""
    if not ranks.stopped:
        for r in range(ranks.nprocs):
            if ranks.alive(r):
                ranks.send(r, ("stop",))
        ranks.reap(2.0)
    ranks.close_lifeline()
    ranks.stop()
    ranks.drain_output()
    ranks.relay.flush()
    ranks.close()


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
