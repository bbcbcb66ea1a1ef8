"""The ranks the kit forks, over pipes: start them, relay their output, collect their replies,
reap their exits, and stop them all.

Ranks start through torch.multiprocessing.start_processes (torch's own process context, its
`_wrap` with parent-death signal and error file) on a forkserver whose interpreter preloads torch
but never the learner's modules and never CUDA: a warm start costs a fork, not a Python + torch
start-up. Supervision is our own: torch's ProcessContext.join gives failing runs a SIGTERM and up
to 30 s of grace, while a rank blocked in a collective must be stopped at once, and output must
be relayed meanwhile.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time

import torch.multiprocessing as tmp

from ..rank.entry import rank_entry
from ..wire import messages
from ..wire.channel import Channel, Unreadable
from ..wire.messages import VERSION, Command, Error, Start, Stream
from . import main_guard
from .base import Failure, Priority, RankSet
from .pipes import RankPipes, read_chunk, read_stack_dumps
from .start import inherited_env, prepare_start_server, rendezvous_env

DRAIN_SECONDS = 1.0  # how long output from finished ranks may keep arriving (their workers)
_REAP_SECONDS = 2.0  # how long persistent ranks told to Stop may take to leave on their own


class ForkedSet(RankSet):
    """The processes of one run. `persistent=True` gives every rank a command channel and a
    control channel (for a pool), and makes any exit a death, since persistent ranks only exit
    when told to."""

    def __init__(self, nprocs: int, start_method: str, *, persistent: bool = False,
                 output="live"):
        super().__init__(nprocs, output)
        self.start_method = start_method
        self.persistent = persistent
        self.ctx = multiprocessing.get_context(start_method)
        self.context = None
        self.pipes = RankPipes(self.ctx, nprocs, persistent)
        self._waiting: dict = {}  # process sentinel -> rank, for ranks not yet exited
        self._closed: set[int] = set()  # ranks whose Process object was closed after reaping

    # -- starting -------------------------------------------------------------------------------

    def start(self, start: Start, env: dict[str, str], port: int) -> None:
        """Start every rank on `start` (a wire Start) with the caller's environment, `env` and
        the rendezvous on `port`."""
        prepare_start_server(self.start_method)
        env = {**os.environ, **env, **rendezvous_env(self.nprocs, port)}
        specs = self.pipes.specs(payload=pickle.dumps(start), version=VERSION, env=env,
                                 sys_path=list(sys.path), cwd=os.getcwd(),
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

    # -- listening ------------------------------------------------------------------------------

    def poll(self, until: float) -> None:
        """Relay output, collect replies and reap exited ranks until something arrives or the
        monotonic time `until`."""
        # Ledger pipes are not waited on: a line per collective would wake the parent for
        # every call (1.8x the cost of a tiny all_reduce on two cores); they are read once
        # per poll instead, which the mismatch rule (several polls apart) never notices.
        waited = [c for c, (s, _) in self.pipes.streams.items() if s is not Stream.LEDGER]
        ready = multiprocessing.connection.wait(
            waited + list(self.pipes.replies) + list(self._waiting),
            max(until - time.monotonic(), 0))
        for conn in [o for o in ready if o not in self._waiting]:
            self._read(conn)
        self._read_ledgers()
        for sentinel in [o for o in ready if o in self._waiting]:
            rank = self._waiting.pop(sentinel)
            proc = self.context.processes[rank]
            proc.join()
            self.exitcodes[rank] = proc.exitcode
            self._drain_replies(rank)

    def _read(self, conn) -> None:
        if conn in self.pipes.replies:
            self._read_reply(conn)
        elif conn in self.pipes.streams:
            stream, rank = self.pipes.streams[conn]
            data = read_chunk(conn)
            if data:
                self._got_output(rank, stream, data)
            else:
                self.pipes.forget(conn)

    def _read_reply(self, channel: Channel) -> None:
        rank = self.pipes.replies[channel]
        try:
            reply = channel.recv()
        except (EOFError, OSError):
            self.pipes.forget(channel)
            return
        except Unreadable as e:  # e.g. an object of a class defined in a %%ranks cell
            reply = Error.unreadable_result(e.cause)
        self._got_reply(rank, reply, time.monotonic())

    def _read_ledgers(self) -> None:
        """Whatever the ledger pipes hold now, without waiting."""
        ledgers = [c for c, (s, _) in self.pipes.streams.items() if s is Stream.LEDGER]
        for conn in multiprocessing.connection.wait(ledgers, 0) if ledgers else []:
            self._read(conn)

    def _drain_replies(self, rank: int) -> None:
        for conn, r in list(self.pipes.replies.items()):
            if r == rank:
                while conn in self.pipes.replies and conn.poll(0):
                    self._read(conn)

    def drain_output(self, seconds: float = 0.0) -> None:
        """Relay what is already in the output pipes; with `seconds`, also what arrives within
        that grace (output of finished ranks' workers)."""
        deadline = time.monotonic() + seconds
        while True:
            outputs = list(self.pipes.streams)
            ready = multiprocessing.connection.wait(
                outputs, max(deadline - time.monotonic(), 0)) if outputs else []
            if not ready:
                return
            for conn in ready:
                self._read(conn)

    # -- what an exit means -------------------------------------------------------------------

    def _exit_failure(self, rank: int, code: int | None) -> Failure | None:
        if rank in self._replies and not self.persistent and code == 0:
            return None  # a launched function that returned, then exited cleanly
        # gloo aborts a rank whose peer vanished mid-collective: a SIGABRT is most often a
        # consequence, so a peer's SIGKILL or segfault is reported first.
        aborted = code == -signal.SIGABRT
        return Failure(Priority.ABORTED if aborted else Priority.DIED, rank, exitcode=code)

    def may_be_abort(self, failure: Failure) -> bool:
        return failure.priority >= Priority.ABORTED  # a SIGABRT, or an error it caused

    def all_exited(self) -> bool:
        """True once every rank process has exited."""
        return not self._waiting

    # -- talking to persistent ranks ----------------------------------------------------------

    def send(self, rank: int, command: Command) -> bool:
        try:
            self.pipes.commands[rank].send(command)
            return True
        except (OSError, ValueError, KeyError):
            return False

    def question(self, ranks: list[int], question, timeout: float = 0.3) -> dict:
        answers: dict = {r: None for r in ranks}
        expected = messages.answers(question)
        asked = {}
        for r in ranks:
            channel = self.pipes.controls.get(r)
            if channel is None or not self.alive(r):
                continue
            try:
                while channel.poll(0):  # a late answer to an earlier question
                    channel.recv()
                channel.send(question)
                asked[channel] = r
            except (OSError, EOFError, ValueError, Unreadable):
                continue
        deadline = time.monotonic() + timeout
        while asked:
            ready = multiprocessing.connection.wait(list(asked),
                                                    max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for channel in ready:
                try:
                    answer = channel.recv()
                except (OSError, EOFError, Unreadable):
                    asked.pop(channel)
                    continue
                if isinstance(answer, expected):  # not a late answer to an earlier question
                    answers[asked.pop(channel)] = answer
        return answers

    def dump_stacks(self, ranks: list[int], seconds: float = 1.0) -> dict[int, str]:
        """Ask each rank's faulthandler for every thread's Python stack (SIGUSR1); the raw text
        per rank, for a hung run's error. Ranks that do not answer get ""."""
        for r in ranks:
            pid = self.pids[r]
            if pid is not None and self.alive(r):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        return read_stack_dumps({r: self.pipes.stacks[r] for r in ranks if r in self.pipes.stacks},
                                seconds) | {r: "" for r in ranks if r not in self.pipes.stacks}

    # -- stopping -------------------------------------------------------------------------------

    def shutdown(self, *, polite: bool = True, drain: float = 0.0) -> None:
        """End the run and free everything: persistent ranks are first told to Stop (so they
        destroy their groups) and given a moment, if `polite`; then the lifeline closes,
        whatever is left is killed, `drain` seconds of late output are relayed, and every
        channel is closed."""
        if self.persistent and polite and not self.stopped:
            self.stop_ranks(_REAP_SECONDS)
        self.pipes.close_lifeline()
        self.kill()
        self.drain_output(drain)
        self.relay.flush()
        self.pipes.close()
        for path in getattr(self.context, "error_files", []) or []:
            with contextlib.suppress(FileNotFoundError, TypeError):
                os.unlink(path)

    def _wait_gone(self, seconds: float) -> None:
        self.reap(seconds)

    def kill(self) -> None:
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
