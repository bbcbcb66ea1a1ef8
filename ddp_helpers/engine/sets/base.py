"""The seam every set of ranks stands behind: what the pool, launch and the rules may ask of
it, the bookkeeping both kinds share (replies, exits, the failure to report, output and the
ledger), and what each kind must say for itself (how to poll, send, ask where a rank is, stop,
and what an exit means)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..wire.messages import (
    AskWhere,
    Command,
    DebugOutput,
    Error,
    Ok,
    Ready,
    Reply,
    Stop,
    Stream,
    Where,
)
from .ledger_reader import LedgerReader
from .relay import OutputRelay

# Words of the errors a rank raises because a peer failed first, not because of its own fault.
_PEER_FAILURE = ("connection closed by peer", "connection reset", "broken pipe",
                 "distbackenderror", "timed out", "keyboardinterrupt")


def looks_like_peer_failure(exc_type: str, message: str) -> bool:
    """An error a rank raises because another rank failed first (not the root cause)."""
    text = f"{exc_type} {message}".lower()
    return any(s in text for s in _PEER_FAILURE)


class Priority(enum.IntEnum):
    """Which failure to report when several ranks failed: the lowest value wins."""

    ROOT_CAUSE = 0  # a rank raised an error of its own
    DIED = 1  # a rank exited without a report: a signal, os._exit, a closed connection
    ABORTED = 2  # a rank died of SIGABRT: gloo aborts a rank whose peer vanished
    KNOCK_ON = 3  # a rank raised because a peer failed first (connection closed, timed out)


@dataclass(frozen=True)
class Failure:
    """The failure to report: which rank, and its Error reply or, if it died, its exit code
    (None where the kit cannot know it: a served rank's connection closed)."""

    priority: Priority
    rank: int
    error: Error | None = None
    exitcode: int | None = None

    @property
    def raised(self) -> bool:
        return self.error is not None


class RankSet:
    """One set of ranks, as the parent sees it. Subclasses say how their ranks are reached
    (poll, send, where, drain_output, shutdown, pids) and what an exit means (_exit_failure,
    may_be_abort); the rest is here."""

    persistent = True  # ranks that serve commands (a pool), not a one-shot launch

    def __init__(self, nprocs: int, output="live"):
        self.nprocs = nprocs
        self.relay = OutputRelay(nprocs, output)
        self.ledger = LedgerReader()  # each rank's collectives in this request, as they enter
        self.exitcodes: dict[int, int | None] = {}  # rank -> how it ended (None: unknown)
        self.replied_at: dict[int, float] = {}  # rank -> monotonic time its reply arrived
        self.stopped = False
        self._replies: dict[int, Reply] = {}
        self._debug: dict[int, list[DebugOutput]] = {}  # pdb's output, in order, per rank

    # -- what the pool and the rules read ----------------------------------------------------

    def replies(self) -> dict[int, Reply]:
        """Each rank's reply to the current request (or, for launch, its function's result)."""
        return dict(self._replies)

    def answered(self, ranks: list[int]) -> bool:
        """True once each of `ranks` has replied."""
        return all(r in self._replies for r in ranks)

    def finished(self) -> list[int]:
        """The ranks whose reply is a success, in rank order."""
        return sorted(r for r, reply in self._replies.items() if isinstance(reply, (Ok, Ready)))

    def alive(self, rank: int) -> bool:
        """True while rank's process (or connection) has not ended."""
        return rank not in self.exitcodes and not self.stopped

    def failure(self) -> Failure | None:
        """The root cause among the failures seen so far, or None."""
        candidates = []
        for rank, reply in self._replies.items():
            if isinstance(reply, Error):
                knock_on = looks_like_peer_failure(reply.type, reply.message)
                candidates.append(Failure(Priority.KNOCK_ON if knock_on else Priority.ROOT_CAUSE,
                                          rank, error=reply))
        for rank, code in self.exitcodes.items():
            if not isinstance(self._replies.get(rank), Error):
                exited = self._exit_failure(rank, code)
                candidates += [exited] if exited is not None else []
        return min(candidates, key=lambda f: (f.priority, f.rank)) if candidates else None

    # -- a request ----------------------------------------------------------------------------

    def ask(self, ranks: list[int], command: Command | None, output) -> None:
        """Begin a request: forget the last one's replies, ledgers and quoted lines, relay
        output as `output` says, and send `command` to each of `ranks` (None: wait for the
        ranks' Ready after start). A dead rank shows up as its exit in poll()."""
        self._replies.clear()
        self.replied_at.clear()
        self.ledger.reset()
        self.relay.begin(output)
        if command is not None:
            for r in ranks:
                self.send(r, command)

    def take_debug_output(self, rank: int) -> list[DebugOutput]:
        """What rank's pdb sent since the last call, in order."""
        return self._debug.pop(rank, [])

    def _got_reply(self, rank: int, reply: Reply, now: float) -> None:
        if isinstance(reply, DebugOutput):  # several per request: kept in order
            self._debug.setdefault(rank, []).append(reply)
            return
        if not isinstance(reply, Error) or rank not in self._replies:
            # a late Error never hides the reply that came first
            self._replies[rank] = reply
            self.replied_at[rank] = now

    def _got_output(self, rank: int, stream: Stream, data: bytes) -> None:
        if stream is Stream.LEDGER:
            self.ledger.feed(rank, data)
        else:
            self.relay.feed(rank, stream, data)

    def stop_ranks(self, seconds: float) -> None:
        """Tell every live rank to Stop (it destroys its group and exits), then give them up to
        `seconds` to go."""
        for r in range(self.nprocs):
            if self.alive(r):
                self.send(r, Stop())
        self._wait_gone(seconds)

    # -- what each kind of set says for itself ------------------------------------------------

    @property
    def pids(self) -> list[int | None]:
        """Each rank's process id where this machine can see it, else None."""
        raise NotImplementedError

    def poll(self, until: float) -> None:
        """Read output, replies and exits until something arrives or the monotonic `until`."""
        raise NotImplementedError

    def send(self, rank: int, command: Command) -> bool:
        """Send a command to a rank; False if its channel is gone (the rank died)."""
        raise NotImplementedError

    def where(self, rank: int, timeout: float = 0.3) -> Where | None:
        """Where the rank's main thread is, asked of a thread of the rank's own; None if it
        does not answer in time (dead, or blocked in C++ code that holds the GIL)."""
        return self.question([rank], AskWhere(), timeout)[rank]

    def question(self, ranks: list[int], question, timeout: float = 0.3) -> dict:
        """Ask each of `ranks` `question` at once (a thread of each rank answers, whatever its
        main thread is doing); {rank: answer}, None for a rank that did not answer in time."""
        raise NotImplementedError

    def drain_output(self, seconds: float = 0.0) -> None:
        """Read what has arrived already; with `seconds`, also what arrives within them."""
        raise NotImplementedError

    def settle_lines(self) -> None:
        """After a death: a moment for the others' last ledger lines, where they travel apart
        from the news of the death (served ranks: another connection each)."""

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's Python stack of each of `ranks`, where the kit can signal them."""
        return {}

    def shutdown(self, *, polite: bool = True, drain: float = 0.0) -> None:
        """End the set and free everything. `polite`: tell live ranks to Stop and give them a
        moment first (not after a failure: ranks stuck in a collective could not read it)."""
        raise NotImplementedError

    def _wait_gone(self, seconds: float) -> None:
        raise NotImplementedError

    def _exit_failure(self, rank: int, code: int | None) -> Failure | None:
        """What rank's exit with `code` counts as (None: not a failure)."""
        raise NotImplementedError

    def may_be_abort(self, failure: Failure) -> bool:
        """Whether `failure` may be gloo aborting a rank whose collective did not fit (so that
        the ledgers' mismatch, if any, is its cause) rather than a cause of its own."""
        raise NotImplementedError
