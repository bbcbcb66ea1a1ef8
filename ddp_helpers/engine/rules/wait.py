"""How long to wait for ranks, and when to stop waiting: the one loop launch and Ranks both
wait in, the give-up rule for a failure, the stall rule for a collective that cannot complete,
and the evidence a wait ends with (what failed, the mismatch that explains it, where each rank
was), gathered once for the words to say.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from ..sets.base import Failure, Priority, RankSet
from ..wire.messages import AskWhere, Error, Where
from .mismatch import Finding, find

SETTLE_SECONDS = 0.5  # a rank whose peer died errors first; its root cause arrives within this
STALL_SECONDS = 3.0  # a rank waiting this long in a collective that cannot complete is stuck
SUBGROUP_SECONDS = 10.0  # a mismatch within a learner's group: named after this, not at once
# How often a running cell's ledgers are compared: the wait loop turns on every message, and
# served ranks send one ledger line per collective; comparing thousands of calls at each turn
# would take the CPU the ranks need.
_COMPARE_SECONDS = 0.25
_POLL_SECONDS = 0.25  # the longest the loop sleeps before re-checking deadlines


class Outcome(enum.Enum):
    """How a wait ended."""

    DONE = "done"  # what was waited for happened
    TIMEOUT = "timeout"  # the deadline passed first
    FAILED = "failed"  # a failure the give-up rule accepted
    STALLED = "stalled"  # no failure, but the stall rule says no rank can make progress
    INTERRUPTED = "interrupted"  # the stop button (KeyboardInterrupt) while waiting


@dataclass
class Evidence:
    """What a wait saw, for the words to say: how it ended, the failure to report (the root
    cause among the ranks' errors and exits), the mismatch that explains it or the stall (found
    once), where each unfinished rank was, who finished, who raised, who exited."""

    outcome: Outcome
    nprocs: int
    targets: list[int]
    failure: Failure | None = None
    finding: Finding | None = None
    where: dict[int, Where | None] = field(default_factory=dict)  # unfinished ranks still alive
    unfinished: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    errors: dict[int, Error] = field(default_factory=dict)  # every rank that raised
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    last_lines: dict[int, str] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)  # faulthandler dumps (launch timeouts)
    at: float = 0.0  # monotonic time the evidence was gathered

    @property
    def ok(self) -> bool:
        """Every target answered and nothing failed."""
        return self.outcome is Outcome.DONE and self.failure is None

    @property
    def state_kept(self) -> bool:
        """A rank raised while every other finished the cell: no rank was lost or left waiting."""
        return self.outcome is Outcome.DONE and not self.exitcodes


def wait(ranks: RankSet, done: Callable[[], bool], deadline: float,
         give_up: Callable[[Failure, bool], bool],
         stalled: Callable[[], bool] | None = None,
         tick: Callable[[], None] | None = None) -> Outcome:
    """Relay output and collect replies until `done()`, the monotonic `deadline`, a failure
    that `give_up(failure, settled)` accepts, or, without any failure, until `stalled()`.
    `settled` turns True SETTLE_SECONDS after the first failure, when a root cause has had
    time to arrive. `tick()` is called at every turn (the live view)."""
    settle_at = None
    while not done():
        if tick is not None:
            tick()
        now = time.monotonic()
        if now >= deadline:
            return Outcome.TIMEOUT
        settling = settle_at if settle_at and settle_at > now else deadline
        ranks.poll(min(deadline, settling, now + _POLL_SECONDS))
        failure = ranks.failure()
        if failure is not None:
            settle_at = settle_at or time.monotonic() + SETTLE_SECONDS
            if give_up(failure, time.monotonic() >= settle_at):
                return Outcome.FAILED
        elif stalled is not None and stalled():
            return Outcome.STALLED
    return Outcome.DONE


def give_up_once_settled(failure: Failure, settled: bool) -> bool:
    """The rule for a run that needs every rank (a launch, or persistent ranks starting): give
    up at once for a root cause or a death; a knock-on error or an abort waits for the settle,
    so that the failure that caused it is the one reported."""
    return failure.priority < Priority.ABORTED or settled


class CellWatch:
    """One persistent-ranks request: who answered, and who is stuck where."""

    def __init__(self, ranks: RankSet, targets: list[int]):
        self.ranks, self.targets = ranks, targets
        self.started = time.monotonic()
        self.seen: dict[int, Where | None] = {}
        self.finding: Finding | None = None  # the mismatch the stall rule acted on, if any
        self._cpu: dict[int, tuple[float, float]] = {}
        self._compared = 0.0  # when mismatched() last compared the ledgers

    def unfinished(self) -> list[int]:
        """The targets that have not replied yet; for a launch, also the ranks whose process
        has not exited after returning a value."""
        if not self.ranks.persistent:
            done = self.ranks.finished()
            return [r for r in self.targets if r not in done or r not in self.ranks.exitcodes]
        replied = self.ranks.replies()
        return [r for r in self.targets if r not in replied]

    def done(self) -> bool:
        return self.ranks.answered(self.targets)

    def give_up(self, failure: Failure, settled: bool) -> bool:
        """Stop at once for a dead rank; after the settle, once every unfinished rank is
        blocked waiting for its peers (it would never finish the cell)."""
        if failure.priority == Priority.DIED:
            return True
        return settled and all(self.blocked(r) for r in self.unfinished())

    def mismatch(self) -> Finding | None:
        """A definite mismatch in the ranks' ledgers (mismatch.find), or None; free to ask,
        since the parent holds the ledgers."""
        done = {r: self.ranks.replied_at.get(r, self.started) for r in self.ranks.finished()}
        return find(self.ranks.ledger.calls, done, self.ranks.nprocs, self.ranks.ledger.gaps)

    def mismatched(self) -> bool:
        """A definite mismatch, and the ranks it involves have stopped moving (blocked, not
        computing): asked only once the ledgers show one, so a sound cell costs no question."""
        now = time.monotonic()
        if now - self._compared < _COMPARE_SECONDS:
            return False
        self._compared = now
        f = self.mismatch()
        if f is None:
            return False
        on_world = "world" in (f.call.group, f.other_call and f.other_call.group)
        if not on_world and time.monotonic() - self.started < SUBGROUP_SECONDS:
            # The default group's timeout is the kit's (the pool's); a group the learner made
            # may have a timeout= of its own, shorter, which a lesson may show ending by itself.
            return False
        finished = self.ranks.finished()
        if self.blocked(f.rank) and (f.other in finished or self.blocked(f.other)):
            self.finding = f
            return True
        return False

    def stalled(self) -> bool:
        """A definite mismatch (mismatched), or: some rank finished (or was not asked) while
        the others have waited STALL_SECONDS in communication: a collective needs every rank of
        its group, so it cannot complete."""
        if self.mismatched():
            return True
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
        return (info is None or info.in_comm) and busy is False

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

    def where_all(self) -> dict[int, Where | None]:
        """Where each unfinished rank that is still alive was: the last look, or a fresh one."""
        missing = [r for r in self.unfinished() if self.ranks.alive(r) and r not in self.seen]
        if missing:  # asked at once: eight ranks stuck in C++ cost one timeout, not eight
            self.seen.update(self.ranks.question(missing, AskWhere()))
        return {r: self.seen.get(r) for r in self.unfinished() if self.ranks.alive(r)}

    def evidence(self, outcome: Outcome, stacks: dict[int, str] | None = None) -> Evidence:
        """What this wait saw, gathered once. The mismatch is looked for where it may explain
        what happened: a stall, or a failure that may be gloo aborting a rank whose collective
        did not fit (and the errors that abort caused in its peers); never over a rank's own
        error or its own death, which are their own cause."""
        ranks = self.ranks
        failure = ranks.failure()
        finding = self.finding
        if finding is None and (outcome is Outcome.STALLED or (
                failure is not None and ranks.may_be_abort(failure))):
            if failure is not None and not failure.raised:
                ranks.settle_lines()
            ranks.drain_output()  # the ledger lines still in the pipes
            finding = self.mismatch()
        replies = ranks.replies()
        return Evidence(outcome, ranks.nprocs, self.targets, failure, finding,
                        where=self.where_all() if outcome is not Outcome.DONE else {},
                        unfinished=self.unfinished(), finished=ranks.finished(),
                        errors={r: e for r, e in replies.items() if isinstance(e, Error)},
                        exitcodes=dict(ranks.exitcodes),
                        last_lines={r: ranks.relay.last_line(r) for r in range(ranks.nprocs)},
                        stacks=stacks or {}, at=time.monotonic())
