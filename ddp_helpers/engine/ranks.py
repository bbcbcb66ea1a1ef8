"""Persistent ranks: start N ranks once, then run code on them a cell at a time, with each
rank's variables kept between cells (`dh.Ranks`, and the `%%ranks` magics built on it).

One pool class, whoever starts its ranks: a starter (starters.py) forks them (`Ranks(2)`) or
listens for the ones torchrun or Slurm starts (`Ranks.listen(4)`). The pool holds the
conversation: a wire.RunCell per cell, a reply per rank, the wait (rules.wait), and the rule for
a failed cell. A rank that raised while every other rank finished the cell leaves every rank's
state intact. A rank that raised or died while others wait for it in a collective (or a cell
past its timeout, or an interrupt) stops every rank: their state is gone, the message
(words.failures) says where each rank was, and the next cell starts a fresh group.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..ledger import Call
from . import debugging
from .live_view import LiveView, display_factory
from .options import check_cell, check_pool, check_push, start_line
from .rules.mismatch import unmatched
from .rules.wait import CellWatch, Evidence, Outcome, give_up_once_settled, wait
from .sets.base import RankSet
from .sets.census import pid_alive
from .starters import Fork, Listen
from .wire.messages import Hello, Push, Ready, RunCell
from .words import failures
from .words.errors import LaunchError, LaunchRefused
from .words.mismatch import unmatched_warning
from .words.places import Labels

_current: Ranks | None = None  # the pool `%%ranks` cells and dh.check(...) use


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
    `Ranks.listen(...)` makes a pool of ranks that torchrun or Slurm starts instead.

    Raises:
        LaunchRefused: bad arguments, before anything starts.
        RankRaised, RankDied, LaunchTimeout: a rank failed to start.
    """

    def __init__(self, nprocs: int = 2, backend: str = "auto", timeout: float = 60, *,
                 group: bool = True, output: str = "live", env: dict | None = None,
                 start_method: str = "forkserver", _starter=None):
        self._env = check_pool(nprocs, backend, timeout, output, env, start_method)
        self.nprocs, self.backend, self.timeout = nprocs, backend, timeout
        self.group, self.output = group, output
        self._starter = _starter or Fork(start_method)
        self.start_method = self._starter.start_method
        self._set: RankSet | None = None
        self._info: list[Ready] = []
        self.cells_run = 0
        self.labels = Labels()  # the cells the magic named: "<cell 12>" -> "In [5]"
        self.stopped_because: str | None = None  # why the ranks are not running, if they are not
        self.failed: dict[int, str] = {}  # rank -> the cell whose failure it keeps ("In [7]")
        self.first_failed: int | None = None  # the rank that failed first in the last failure
        self.snapshot = None  # each rank's stack when the kit last stopped them (Snapshot)
        self._cell: str | None = None  # the cell being run, as the learner names it
        self._finalizer = None  # stops the ranks if the pool is dropped
        self._starter.prepare(self)
        if self._starter.starts_at_once:
            self.start()

    @classmethod
    def listen(cls, nprocs: int = 2, host: str = "127.0.0.1", port: int = 0,
               timeout: float = 60, *, backend: str = "auto", group: bool = True,
               output: str = "live", env: dict | None = None,
               token_file: str | None = None) -> Ranks:
        """A pool of `nprocs` ranks that torchrun (or srun) starts with `python -m
        ddp_helpers.serve --connect pool.address --token-file pool.token_file`; not ready until
        `pool.wait_ready(seconds)` (or the first run()). Listens on loopback unless `host`
        says otherwise. Then run/get/push/status/stop work as for `Ranks(...)`."""
        return cls(nprocs, backend, timeout, group=group, output=output, env=env,
                   _starter=Listen(host, port, token_file))

    def __repr__(self) -> str:
        return f"<{self.nprocs} {self._starter.describe(self)}>"

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks (if they are not running) and wait until each has set up; for a
        listening pool, wait until torchrun's ranks have attached (see wait_ready)."""
        if self._set is None:
            self._starter.start(self)

    def attach(self, ranks: RankSet, seconds: float) -> None:
        """Take `ranks` (a starter's) as this pool's, and wait `seconds` for each's Ready."""
        self._set = ranks
        self._finalizer = weakref.finalize(self, ranks.shutdown)
        self.failed, self.first_failed, self.snapshot = {}, None, None
        self._info = self._request(None, list(range(self.nprocs)), seconds, self.output,
                                   starting=True)
        self.stopped_because = None
        make_current(self)

    def stop(self) -> None:
        """Stop every rank (their state is gone); a later run() raises until restart()."""
        self._shutdown()
        self._starter.close()
        self.stopped_because = "stopped"

    def restart(self) -> None:
        """Stop the ranks if running and start fresh ones: a new group, empty namespaces."""
        self._starter.check_restart()
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
        targets = check_cell(code, targets, timeout, output, self.nprocs, returns)
        self._starter.before_cell(self)
        self.cells_run += 1
        self.labels.name(f"<cell {self.cells_run}>", label)
        self._cell = self.labels.cell(f"<cell {self.cells_run}>")
        try:
            replies = self._request(RunCell(self.cells_run, code, tuple(returns or ()),
                                            first_line), targets, timeout, output)
        finally:
            self._cell = None
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
        self._starter.before_cell(self)
        self._request(Push(values), targets, self.timeout, self.output)

    # -- looking inside the ranks (debugging.py) ---------------------------------------------

    def debug(self, rank: int | None = None, commands: list[str] | None = None) -> None:
        """pdb post-mortem on rank `rank`'s last failing cell (default: the rank that failed
        first), commands read through input() (the notebook's input box) or from `commands`;
        `q` or two empty lines leave it, and every rank keeps its state. After the kit stopped
        the ranks: what that rank held then (its stack, each frame's variables), read-only."""
        debugging.post_mortem(self, rank, commands)

    def where(self):
        """Every rank's stack now, each frame's variables summarised (after the kit stopped
        the ranks: as they were then); prints as a report, indexes as {rank: Stack}."""
        return debugging.where(self)

    def compare(self, *expressions: str):
        """Each value (a name or an expression: a tensor, a module, an optimizer, a list, a
        number) on every rank: dtype, shape and a digest per rank, whether all ranks hold the
        same bytes, and where the first differing tensor differs."""
        if not expressions or not all(isinstance(e, str) and e.strip() for e in expressions):
            raise LaunchRefused("compare: name what to compare, e.g. pool.compare('model', "
                                "'x') (%ranks compare model x).")
        return debugging.compare(self, expressions)

    def _run_command(self, command) -> list:
        """Send one command to every rank; each rank's Ok value, in rank order."""
        self._starter.before_cell(self)
        return [reply.value for reply in self._request(command, list(range(self.nprocs)),
                                                       self.timeout, "none")]

    def collectives(self) -> dict[int, list[Call]]:
        """The collectives and send/recv calls each rank made in the last cell, in order, as
        the ledger recorded them ({rank: [Call, ...]}; what `%%ranks --ledger` prints)."""
        if self._set is None:
            return {}
        return {r: [call for call, _ in entries] for r, entries in self._set.ledger.calls.items()}

    def place(self, where: tuple[str, int]) -> str:
        """A call's place as the learner sees it: "In [5], line 4"."""
        return self.labels.place(where)

    def status(self) -> RanksStatus:
        """Which ranks are alive, their pids, device and backend, and how many cells ran (and,
        for ranks torchrun started, each one's host, node and local rank)."""
        hellos = self._starter.hellos(self)
        if self._set is None:
            return RanksStatus(self.nprocs, False, self.cells_run, [], self.stopped_because,
                               kind=self._starter.kind, restarts=self._starter.restarts)
        pids = self._set.pids
        info = self._info or [None] * self.nprocs
        rows = [RankRow(r, self._set.alive(r) and (hellos is not None or pid_alive(pid)),
                        hellos[r].pid if hellos else pid, ready and ready.device,
                        ready and ready.backend, hellos[r] if hellos else None)
                for r, (pid, ready) in enumerate(zip(pids, info))]
        return RanksStatus(self.nprocs, True, self.cells_run, rows, None,
                           kind=self._starter.kind, restarts=self._starter.restarts)

    # -- ranks that torchrun or Slurm started (Ranks.listen) ----------------------------------

    @property
    def address(self) -> str:
        """host:port for `python -m ddp_helpers.serve --connect` (a listening pool)."""
        return self._starter.listening(self).address

    @property
    def token_file(self) -> str:
        """The token file (mode 0600) for `--token-file`: the ranks' host must be able to read
        it (a shared home directory on a cluster)."""
        return self._starter.listening(self).token_file

    @property
    def refusals(self) -> int:
        """How many connections were turned away (no token, a wrong one, too many)."""
        return self._starter.listening(self).refusals

    @property
    def restarts(self) -> int:
        """How often torchrun restarted the workers so far (0 for ranks the kit forked)."""
        return self._starter.restarts

    def connected(self) -> int:
        """How many ranks have attached so far (a listening pool)."""
        return len(self._starter.listening(self).attached)

    def command_lines(self, nnodes: int = 1) -> dict[str, str]:
        """What to paste: a torchrun line per node and an srun line, address and token filled in."""
        return self._starter.command_lines(self, nnodes)

    def wait_ready(self, timeout: float = 300, progress: bool = True) -> None:
        """Wait until every rank torchrun started has attached and set up its process group.

        Raises:
            LaunchRefused: not every rank attached within `timeout`.
            RankRaised, RankDied: a rank failed while setting up.
        """
        self._starter.wait_ready(self, timeout, progress)

    def hosts(self) -> list[Hello]:
        """Each attached rank's Hello (host, GROUP_RANK, LOCAL_RANK, pid), in rank order."""
        return self._starter.hellos(self) or []

    # -- one request ----------------------------------------------------------------------------

    def _request(self, command, targets: list[int], timeout: float, output: str, *,
                 starting: bool = False) -> list:
        """Send `command` (None: wait for the ranks' Ready) and wait; each target's reply."""
        ranks = self._set
        ranks.ask(targets, command, output)
        watch = CellWatch(ranks, targets)
        view = LiveView(watch, self.labels, display_factory() if isinstance(command, RunCell)
                        else None)
        deadline = time.monotonic() + timeout
        try:
            if starting:
                outcome = wait(ranks, watch.done, deadline, give_up_once_settled)
            else:
                outcome = wait(ranks, watch.done, deadline, watch.give_up, watch.stalled,
                               view.tick)
        except KeyboardInterrupt:  # the stop button in Jupyter: one sentence, no kit frames
            view.close()
            raise self._failed(watch.evidence(Outcome.INTERRUPTED), timeout, starting) from None
        except BaseException:
            view.close()
            evidence = watch.evidence(Outcome.INTERRUPTED)
            self._snapshot()
            stopped = self._drop(evidence, polite=True)
            print(f"ddp_helpers: {failures.stopped(stopped, self._where(evidence))}", flush=True)
            raise
        view.close()
        ranks.drain_output()
        ranks.relay.flush()
        if outcome is Outcome.DONE and ranks.failure() is None:
            if isinstance(command, RunCell):
                self._warn_unmatched(targets)
            replies = ranks.replies()
            return [replies[r] for r in targets]
        raise self._failed(watch.evidence(outcome), timeout, starting)

    def _warn_unmatched(self, targets: list[int]) -> None:
        """Every rank finished the cell: say so if their collectives do not pair anyway. Not
        under TORCH_DISTRIBUTED_DEBUG=DETAIL: its wrapper compares every call's fingerprint on
        a helper group before the op reaches the real one, so the only way such a cell ends is
        a mismatch it raised (and the learner caught), with the real group still in step."""
        if {**os.environ, **self._env}.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            return
        ledger = self._set.ledger
        found = unmatched(ledger.calls, targets, self.nprocs, ledger.gaps)
        if found is not None:
            print(unmatched_warning(found, self.labels.place), flush=True)

    def _failed(self, ev: Evidence, timeout: float, starting: bool) -> LaunchError:
        """The error for a request that failed; every rank is stopped first unless a rank
        raised while every other one finished the cell."""
        run = self._run_words("start" if starting else "cell", None, timeout)  # while attached
        keep = ev.outcome is Outcome.DONE and not starting and not ev.exitcodes
        if keep:
            self._keep_failures(ev)
            return failures.error(ev, run)
        snapshot = self._snapshot()
        polite = ev.finding is None and ev.outcome is not Outcome.INTERRUPTED
        run.stopped = self._drop(ev, polite=polite)
        error = failures.error(ev, run)
        error.where = snapshot
        return error

    def _keep_failures(self, ev: Evidence) -> None:
        """The ranks that raised keep their exceptions (and frames) for post-mortem."""
        if self._cell is not None:
            self.failed.update({r: self._cell for r in ev.errors})
            self.first_failed = ev.failure.rank

    def _snapshot(self):
        """Every live rank's stack, before the kit stops them (also kept for %ranks debug)."""
        self.snapshot = debugging.snapshot(self, list(range(self.nprocs)),
                                           "when the kit stopped them")
        self.failed = {}
        return self.snapshot

    def _run_words(self, kind: str, stopped, timeout: float) -> failures.Run:
        return failures.Run(kind, stopped, place=self.labels.place,
                            name_cells=self.labels.traceback, where=self.labels.where,
                            who=self._starter.who(self), timeout=timeout)

    def _where(self, ev: Evidence) -> str:
        return failures.where_text(ev, self._run_words("cell", None, self.timeout))

    def _drop(self, ev: Evidence, *, polite: bool) -> failures.Stopped:
        """Stop every rank after a failure; what was done, for the words to say."""
        reason = failures.stop_reason(ev, self._starter.host(self))
        f = ev.failure
        dead = (f.rank,) if f is not None and not f.raised and ev.finding is None else ()
        return self._starter.drop(self, reason, dead, polite)

    def _shutdown(self, *, polite: bool = True) -> None:
        """Stop the ranks, if running (the starter decides what comes next)."""
        if self._set is not None:
            self._finalizer.detach()
            self._set.shutdown(polite=polite)
        self._set = None


def current() -> Ranks | None:
    """The pool started last (by `%ranks start` or `dh.Ranks(...)`), running or not."""
    return _current


def make_current(pool: Ranks | None) -> None:
    """Make `pool` the one `%%ranks` cells and dh.check use."""
    global _current
    _current = pool


def forget_current() -> None:
    """No pool is current any more (the next `%%ranks` asks for `%ranks start`)."""
    make_current(None)


def start_command(pool: Ranks | None = None) -> str:
    """The magic that brings the ranks back, sized as the last pool was: `%ranks start 3`
    (the one command every message gives, whether the ranks were stopped or never started),
    with the backend if one was named (options.start_line)."""
    pool = pool or _current
    return start_line(2) if pool is None else start_line(pool.nprocs, pool.backend)


@dataclass
class RankRow:
    """One rank in a status report."""

    rank: int
    alive: bool
    pid: int | None
    device: str | None
    backend: str | None
    hello: Hello | None = None  # ranks torchrun started: host, node, local rank


@dataclass
class RanksStatus:
    """What `Ranks.status()` returns; prints as a short table."""

    nprocs: int
    running: bool
    cells_run: int
    ranks: list[RankRow] = field(default_factory=list)
    stopped_because: str | None = None
    kind: str = "ranks"  # "served ranks" for ranks torchrun started
    restarts: int = 0

    @property
    def hellos(self) -> list[Hello]:
        return [r.hello for r in self.ranks if r.hello is not None]

    def __str__(self) -> str:
        if not self.running:
            return f"{self.nprocs} {self.kind}, not running ({self.stopped_because or 'stopped'})"
        if not self.hellos:
            head = f"{self.nprocs} ranks running, {self.cells_run} cells run"
            rows = [f"  rank {r.rank}: {'alive' if r.alive else 'DEAD'}, pid {r.pid}, device "
                    f"{r.device}, backend {r.backend or 'none (no process group)'}"
                    for r in self.ranks]
            return "\n".join([head, *rows])
        head = f"{self.nprocs} served ranks attached, {self.cells_run} cells run"
        most = max(h.max_restarts for h in self.hellos)
        if most:
            head += f", torchrun restarts so far: {self.restarts} (--max-restarts {most})"
        rows = [f"  rank {r.rank}: {'alive' if r.alive else 'DEAD'}, host {r.hello.host}, "
                f"GROUP_RANK {r.hello.group_rank}, LOCAL_RANK {r.hello.local_rank}, pid "
                f"{r.hello.pid}, device {r.device}" for r in self.ranks]
        return "\n".join([head, *rows])

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


__all__ = ["CellResult", "LaunchRefused", "Ranks", "RanksStatus", "current", "start_command"]
