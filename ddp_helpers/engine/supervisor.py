"""Parent side of every run, one-shot (`launch`) or persistent (`Ranks`): start the rank
processes, relay their output, collect their reports, notice failures, and stop them all.

Ranks start through torch.multiprocessing.start_processes (torch's own process context, its
`_wrap` with parent-death signal and error file) on a forkserver whose interpreter preloads torch
but never the learner's modules and never CUDA: a warm start costs a fork, not a Python + torch
start-up. Supervision is our own: torch's ProcessContext.join gives failing runs a SIGTERM and up
to 30 s of grace, while a rank blocked in a collective must be stopped at once, and output must
be relayed meanwhile. This module observes; errors.py words what it observed, and the policies
(launch.py, ranks.py, with watch.py's rules) decide what to do about it.
"""

from __future__ import annotations

import contextlib
import enum
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch.multiprocessing as tmp

from . import main_guard
from .ledger_feed import LedgerReader
from .pipes import RankPipes, read_chunk, read_stack_dumps
from .protocol import AskWhere, Channel, Command, Error, Ok, Ready, Reply, Stop, Unreadable, Where
from .rank_entry import rank_entry
from .relay import OutputRelay
from .start import inherited_env, prepare_start_server, rendezvous_env

DRAIN_SECONDS = 1.0  # how long output from finished ranks may keep arriving (their workers)
_REAP_SECONDS = 2.0  # how long persistent ranks told to Stop may take to leave on their own


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
    DIED = 1  # a rank exited without a report: a signal, os._exit
    ABORTED = 2  # a rank died of SIGABRT: gloo aborts a rank whose peer vanished
    KNOCK_ON = 3  # a rank raised because a peer failed first (connection closed, timed out)


@dataclass(frozen=True)
class Failure:
    """The failure to report: which rank, and its Error reply or, if it died, its exit code."""

    priority: Priority
    rank: int
    error: Error | None = None
    exitcode: int | None = None

    @property
    def raised(self) -> bool:
        return self.error is not None


class ReplyPolicy:
    """What the watch and the failure rules read of a set of ranks, from `_replies` (rank ->
    its reply to the current request), `exitcodes` and `stopped`: shared by RankSet (forked
    ranks, pipes) and ServedSet (attached ranks, sockets), which say how an exit counts."""

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

    def _exit_failure(self, rank: int, code: int | None) -> Failure | None:
        raise NotImplementedError


class RankSet(ReplyPolicy):
    """The processes of one run: their channels, what they replied and how they exited.

    `persistent=True` gives every rank a command channel and a control channel (for `Ranks`),
    and makes any exit a death, since persistent ranks only exit when told to. The policies
    (launch.py, ranks.py, watch.py) call this class; it never calls them.
    """

    def __init__(self, nprocs: int, start_method: str, *, persistent: bool = False):
        self.nprocs = nprocs
        self.start_method = start_method
        self.persistent = persistent
        self.ctx = multiprocessing.get_context(start_method)
        self.relay = OutputRelay(nprocs)
        self.exitcodes: dict[int, int] = {}
        self.context = None
        self.stopped = False
        self.pipes = RankPipes(self.ctx, nprocs, persistent)
        self.ledger = LedgerReader()  # each rank's collectives in this request, as they enter
        self._replies: dict[int, Reply] = {}
        self.replied_at: dict[int, float] = {}  # rank -> monotonic time its reply arrived
        self._waiting: dict = {}  # process sentinel -> rank, for ranks not yet exited
        self._closed: set[int] = set()  # ranks whose Process object was closed after reaping

    # -- starting -------------------------------------------------------------------------------

    def start(self, payload: bytes, env: dict[str, str], port: int, output) -> None:
        """Start every rank on `payload` (a pickled (fn, args)) with the caller's environment,
        `env` and the rendezvous on `port`, relaying their output as `output` says."""
        self.relay_to(output)
        prepare_start_server(self.start_method)
        env = {**os.environ, **env, **rendezvous_env(self.nprocs, port)}
        specs = self.pipes.specs(payload=payload, env=env, sys_path=list(sys.path),
                                 cwd=os.getcwd(),
                                 start_method=multiprocessing.get_start_method(allow_none=True))
        with inherited_env(env if self.start_method == "spawn" else None), \
                main_guard.main_hidden():
            self.context = tmp.start_processes(rank_entry, args=(specs,), nprocs=self.nprocs,
                                               join=False, start_method=self.start_method)
        self.pipes.handed_over(specs)
        self._waiting = {p.sentinel: r for r, p in enumerate(self.context.processes)}

    @property
    def pids(self) -> list[int | None]:
        """Each rank's process id (None before start and once reaped)."""
        procs = dict(self._open_processes())
        return [procs[r].pid if r in procs else None for r in range(self.nprocs)]

    def relay_to(self, output) -> None:
        """Where the ranks' output lines go from now on (see OutputRelay)."""
        self.relay.mode = output

    # -- listening ------------------------------------------------------------------------------

    def poll(self, until: float) -> None:
        """Relay output, collect replies and reap exited ranks until something arrives or the
        monotonic time `until`."""
        # Ledger pipes are not waited on: a line per collective would wake the parent for
        # every call (1.8x the cost of a tiny all_reduce on two cores); they are read once
        # per poll instead, which the mismatch rule (several polls apart) never notices.
        waited = [c for c, (kind, _) in self.pipes.readers.items() if kind != "led"]
        ready = multiprocessing.connection.wait(waited + list(self._waiting),
                                                max(until - time.monotonic(), 0))
        for conn in [o for o in ready if o in self.pipes.readers]:
            self._read(conn)
        self._read_ledgers()
        for sentinel in [o for o in ready if o in self._waiting]:
            rank = self._waiting.pop(sentinel)
            proc = self.context.processes[rank]
            proc.join()
            self.exitcodes[rank] = proc.exitcode
            self._drain_replies(rank)

    def _read(self, conn) -> None:
        kind, rank = self.pipes.readers[conn]
        if kind == "res":
            self._read_reply(conn, rank)
        else:
            self._read_output(conn, rank, kind)

    def _read_reply(self, channel: Channel, rank: int) -> None:
        try:
            reply = channel.recv()
        except (EOFError, OSError):
            self.pipes.forget(channel)
            return
        except Unreadable as e:  # e.g. an object of a class defined in a %%ranks cell
            reply = Error.unreadable_result(e.cause)
        if not isinstance(reply, Error) or rank not in self._replies:
            # a late Error never hides the reply that came first
            self._replies[rank] = reply
            self.replied_at[rank] = time.monotonic()

    def _read_output(self, conn, rank: int, kind: str) -> None:
        data = read_chunk(conn)
        if data and kind == "led":
            self.ledger.feed(rank, data)
        elif data:
            self.relay.feed(rank, kind, data)
        else:
            self.pipes.forget(conn)

    def _read_ledgers(self) -> None:
        """Whatever the ledger pipes hold now, without waiting."""
        ledgers = [c for c, (kind, _) in self.pipes.readers.items() if kind == "led"]
        for conn in multiprocessing.connection.wait(ledgers, 0) if ledgers else []:
            self._read(conn)

    def _drain_replies(self, rank: int) -> None:
        for conn, (kind, r) in list(self.pipes.readers.items()):
            if r == rank and kind == "res":
                while conn in self.pipes.readers and conn.poll(0):
                    self._read(conn)

    def drain_output(self, seconds: float = 0.0) -> None:
        """Relay what is already in the output pipes; with `seconds`, also what arrives within
        that grace (output of finished ranks' workers)."""
        deadline = time.monotonic() + seconds
        while True:
            outputs = [c for c, (kind, _) in self.pipes.readers.items() if kind != "res"]
            ready = multiprocessing.connection.wait(
                outputs, max(deadline - time.monotonic(), 0)) if outputs else []
            if not ready:
                return
            for conn in ready:
                self._read(conn)

    # -- what policy reads (ReplyPolicy, plus how an exit counts) ------------------------------

    def _exit_failure(self, rank: int, code: int | None) -> Failure | None:
        if rank in self._replies and not self.persistent and code == 0:
            return None  # a launched function that returned, then exited cleanly
        # gloo aborts a rank whose peer vanished mid-collective: a SIGABRT is most often a
        # consequence, so a peer's SIGKILL or segfault is reported first.
        aborted = code == -signal.SIGABRT
        return Failure(Priority.ABORTED if aborted else Priority.DIED, rank, exitcode=code)

    def all_exited(self) -> bool:
        """True once every rank process has exited."""
        return not self._waiting

    # -- persistent ranks -----------------------------------------------------------------------

    def ask(self, ranks: list[int], command: Command | None, output) -> None:
        """Begin a request: forget the last one's replies, relay output as `output` says, and
        send `command` to each of `ranks` (None: wait for the ranks' Ready after start)."""
        self._replies.clear()
        self.replied_at.clear()
        self.ledger.reset()
        self.relay_to(output)
        if command is not None:
            for r in ranks:
                self.send(r, command)  # a dead rank shows up as its exit in poll()

    def send(self, rank: int, command: Command) -> bool:
        """Send a command to a persistent rank; False if its channel is gone (the rank died)."""
        try:
            self.pipes.commands[rank].send(command)
            return True
        except (OSError, ValueError):
            return False

    def where(self, rank: int, timeout: float = 0.3) -> Where | None:
        """Ask a persistent rank's control thread where its main thread is, or None if it does
        not answer in time (dead, or blocked in C++ code that holds the GIL)."""
        channel = self.pipes.controls.get(rank)
        if channel is None or not self.alive(rank):
            return None
        try:
            while channel.poll(0):  # a late answer to an earlier question
                channel.recv()
            channel.send(AskWhere())
            return channel.recv() if channel.poll(timeout) else None
        except (OSError, EOFError, ValueError, Unreadable):
            return None

    def dump_stacks(self, ranks: list[int], seconds: float = 1.0) -> dict[int, str]:
        """Ask each rank's faulthandler for every thread's Python stack (SIGUSR1); return the
        raw text per rank, for a hung run's error. Ranks that do not answer get ""."""
        for r in ranks:
            pid = self.pids[r]
            if pid is not None and self.alive(r):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        return read_stack_dumps({r: self.pipes.stacks[r] for r in ranks if r in self.pipes.stacks},
                                seconds) | {r: "" for r in ranks if r not in self.pipes.stacks}

    # -- stopping -------------------------------------------------------------------------------

    def shutdown(self, drain: float = 0.0, *, polite: bool = True) -> None:
        """End the run and free everything: persistent ranks are first told to Stop (so they
        destroy their groups) and given a moment, unless `polite` is False (ranks stuck in a
        collective could not read it); then the lifeline closes, whatever is left is
        killed, `drain` seconds of late output are relayed, and every channel is closed."""
        if self.persistent and polite and not self.stopped:
            for r in range(self.nprocs):
                if self.alive(r):
                    self.send(r, Stop())
            self.reap(_REAP_SECONDS)
        self.close_lifeline()
        self.stop()
        self.drain_output(drain)
        self.relay.flush()
        self.close()

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
        self.pipes.close()
        for path in getattr(self.context, "error_files", []) or []:
            with contextlib.suppress(FileNotFoundError, TypeError):
                os.unlink(path)

    def close_lifeline(self) -> None:
        """Tell the ranks the parent is done with them: each then kills its process group."""
        self.pipes.close_lifeline()
