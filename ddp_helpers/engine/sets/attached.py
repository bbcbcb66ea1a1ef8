"""The ranks torchrun or Slurm started (`python -m ddp_helpers.serve`), attached over the sockets
the listener let in: the same seam as forked ranks, one connection per rank carrying
everything the pipes carry apart (commands and questions one way; replies, answers, output and
ledger lines the other).

What differs is what a death looks like (the connection closes: the kit did not start the
process, so it has no exit code) and what stopping means: a served rank told to Stop destroys
its group and exits 0, so torchrun ends cleanly; a connection closed without a Stop makes the
rank exit with a failure code (rank.serve), so that every torchrun agent ends or restarts.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import socket
import time

from ..wire.channel import Unreadable
from ..wire.messages import Command, Error, Hello, Output, Stack, Where, answers
from .base import Failure, Priority, RankSet

_LINES_GRACE_SECONDS = 0.25  # after a death, how long the others' ledger lines may take
_STOP_SECONDS = 5.0  # how long served ranks told to Stop may take to close their connections


class AttachedSet(RankSet):
    """The attached ranks of one pool: their channels, and who closed the connection."""

    def __init__(self, nprocs: int, attached: dict, output="live"):
        super().__init__(nprocs, output)
        self.hellos: dict[int, Hello] = {r: a.hello for r, a in attached.items()}
        self.chans = {r: a.chan for r, a in attached.items()}
        self._answers: dict[int, Where | Stack] = {}  # answers to the last question, by rank

    @property
    def pids(self) -> list[int | None]:
        """Pids of ranks on this host (another host's pids mean nothing here)."""
        here = socket.gethostname()
        return [h.pid if h.host == here and self.alive(r) else None
                for r, h in sorted(self.hellos.items())]

    # -- listening ------------------------------------------------------------------------------

    def poll(self, until: float) -> None:
        live = {c: r for r, c in self.chans.items() if r not in self.exitcodes}
        ready = multiprocessing.connection.wait(list(live), max(until - time.monotonic(), 0))
        for chan in ready:
            self._read(live[chan])

    def _read(self, rank: int) -> None:
        try:
            message = self.chans[rank].recv()
        except (EOFError, OSError):
            self.exitcodes.setdefault(rank, None)  # gone: killed, or its node went away
            return
        except Unreadable as e:
            message = Error.unreadable_result(e.cause)
        if isinstance(message, Output):
            self._got_output(rank, message.stream, message.data)
        elif isinstance(message, (Where, Stack)):
            self._answers[rank] = message
        else:
            self._got_reply(rank, message, time.monotonic())

    def drain_output(self, seconds: float = 0.0) -> None:
        """Read what has already arrived (a rank sends its output before its reply)."""
        deadline = time.monotonic() + seconds
        while True:
            live = {c: r for r, c in self.chans.items() if r not in self.exitcodes}
            ready = multiprocessing.connection.wait(list(live),
                                                    max(deadline - time.monotonic(), 0))
            if not ready:
                return
            for chan in ready:
                self._read(live[chan])

    def settle_lines(self) -> None:
        # The others' last lines were sent before the data that killed the dead rank, but
        # over connections of their own: they may still be on their way.
        self.drain_output(_LINES_GRACE_SECONDS)

    # -- what an exit means -------------------------------------------------------------------

    def _exit_failure(self, rank: int, code: int | None) -> Failure:
        return Failure(Priority.DIED, rank, exitcode=None)  # a closed connection: a death

    def may_be_abort(self, failure: Failure) -> bool:
        # A closed connection is all a served rank's death shows, and gloo aborting a rank
        # whose collective's sizes did not fit is one.
        return failure.priority >= Priority.DIED

    # -- talking to the ranks -----------------------------------------------------------------

    def send(self, rank: int, command: Command) -> bool:
        try:
            self.chans[rank].send(command)
            return True
        except (OSError, ValueError):
            return False

    def question(self, ranks: list[int], question, timeout: float = 0.3) -> dict:
        for r in ranks:
            self._answers.pop(r, None)
        expected = answers(question)
        asked = [r for r in ranks if self.alive(r) and self.send(r, question)]
        deadline = time.monotonic() + timeout

        def answered(r: int) -> bool:
            return isinstance(self._answers.get(r), expected) or not self.alive(r)

        while not all(answered(r) for r in asked) and time.monotonic() < deadline:
            self.poll(deadline)
        return {r: a if isinstance(a := self._answers.pop(r, None), expected) else None
                for r in ranks}

    # -- stopping -------------------------------------------------------------------------------

    def shutdown(self, *, polite: bool = True, drain: float = 0.0) -> None:
        """Tell every rank to Stop and wait for the connections to close, if `polite`; then
        close them: a rank whose connection closes without a Stop exits with a failure code,
        so that every torchrun agent ends (or restarts) instead of waiting in its exit barrier
        for the node that failed."""
        if polite and not self.stopped:
            self.stop_ranks(_STOP_SECONDS)
        self.stopped = True
        self.relay.flush()
        for chan in self.chans.values():
            with contextlib.suppress(OSError):
                chan.close()

    def _wait_gone(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(r not in self.exitcodes for r in self.chans) and time.monotonic() < deadline:
            self.poll(min(deadline, time.monotonic() + 0.25))
