"""Persistent ranks that torchrun or Slurm started (`dh.Ranks.listen`, `%ranks listen N`): the
same pool as `dh.Ranks`, over sockets instead of pipes.

`ServedSet` stands where supervisor.RankSet stands for forked ranks: it sends commands, relays
output, collects replies and notices deaths, so that the cell loop, the failure rules and the
error texts of ranks.py and watch.py apply unchanged. What differs is what a death looks like
(the connection closes: the kit did not start the process, so it has no exit code) and what
comes after one: the kit cannot start served ranks again; torchrun (or a new job) must. Under
`torchrun --max-restarts K` it does: the pool keeps listening, takes the fresh group on the
next cell, and says once that the old one's variables are gone.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import socket
import time
import weakref

from .errors import LaunchRefused, RankDied
from .ledger_feed import LedgerReader
from .listen import Attached, Listener
from .options import check_pool
from .protocol import AskWhere, Command, Error, Ready, Reply, Stop, Unreadable, Where
from .ranks import RankRow, Ranks, RanksStatus
from .relay import OutputRelay
from .sockets import Hello, Output, Setup, restarts_left
from .supervisor import Failure, Priority, ReplyPolicy
from .watch import Outcome

_LINES_GRACE_SECONDS = 0.25  # after a death, how long the others' ledger lines may take
_STOP_SECONDS = 5.0  # how long served ranks told to Stop may take to close their connections


class ServedSet(ReplyPolicy):
    """The attached ranks of one pool: their channels, replies, and who closed the connection."""

    persistent = True

    def __init__(self, nprocs: int, attached: dict[int, Attached], output):
        self.nprocs = nprocs
        self.hellos: dict[int, Hello] = {r: a.hello for r, a in attached.items()}
        self.chans = {r: a.chan for r, a in attached.items()}
        self.relay = OutputRelay(nprocs, output)
        self.ledger = LedgerReader()  # each rank's collectives in this request, as they enter
        self.replied_at: dict[int, float] = {}  # rank -> monotonic time its reply arrived
        self.exitcodes: dict[int, int | None] = {}  # rank -> None: its connection closed
        self.stopped = False
        self._replies: dict[int, Reply] = {}
        self._wheres: dict[int, Where] = {}

    @property
    def pids(self) -> list[int | None]:
        """Pids of ranks on this host (another host's pids mean nothing here)."""
        here = socket.gethostname()
        return [h.pid if h.host == here and self.alive(r) else None
                for r, h in sorted(self.hellos.items())]

    def relay_to(self, output) -> None:
        self.relay.mode = output

    # -- listening ------------------------------------------------------------------------------

    def poll(self, until: float) -> None:
        """Read whatever arrives (output, replies, answers) until something does or `until`."""
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
        if isinstance(message, Output) and message.kind == "led":
            self.ledger.feed(rank, message.data)
        elif isinstance(message, Output):
            self.relay.feed(rank, message.kind, message.data)
        elif isinstance(message, Where):
            self._wheres[rank] = message
        elif not isinstance(message, Error) or rank not in self._replies:
            self._replies[rank] = message
            self.replied_at[rank] = time.monotonic()

    def drain_output(self, seconds: float = 0.0) -> None:
        """Read what has already arrived (a rank sends its output before its reply)."""
        deadline = time.monotonic() + seconds
        while True:
            live = [c for r, c in self.chans.items() if r not in self.exitcodes]
            ready = multiprocessing.connection.wait(live, max(deadline - time.monotonic(), 0))
            if not ready:
                return
            for chan in ready:
                self._read(next(r for r, c in self.chans.items() if c is chan))

    # -- what policy reads (ReplyPolicy, plus how an exit counts) ------------------------------

    def _exit_failure(self, rank: int, code: int | None) -> Failure:
        return Failure(Priority.DIED, rank, exitcode=None)  # a closed connection: a death

    # -- persistent ranks -----------------------------------------------------------------------

    def ask(self, ranks: list[int], command: Command | None, output) -> None:
        self._replies.clear()
        self.replied_at.clear()
        self.ledger.reset()
        self.relay_to(output)
        if command is not None:
            for r in ranks:
                self.send(r, command)

    def send(self, rank: int, command) -> bool:
        try:
            self.chans[rank].send(command)
            return True
        except (OSError, ValueError):
            return False

    def where(self, rank: int, timeout: float = 0.3) -> Where | None:
        """Ask the rank's command thread where its main thread is (None: no answer in time)."""
        if not self.alive(rank) or not self.send(rank, AskWhere()):
            return None
        self._wheres.pop(rank, None)
        deadline = time.monotonic() + timeout
        while rank not in self._wheres and self.alive(rank) and time.monotonic() < deadline:
            if self.chans[rank].poll(max(deadline - time.monotonic(), 0)):
                self._read(rank)
        return self._wheres.pop(rank, None)

    # -- stopping -------------------------------------------------------------------------------

    def shutdown(self, drain: float = 0.0, clean: bool = True) -> None:
        """Tell every rank to Stop (it destroys its group and exits 0, so torchrun ends), wait
        for the connections to close, then close them: a rank whose connection closes exits.
        `clean=False` (after a failure) closes them at once: the ranks exit with a failure
        code, so that every torchrun agent ends (or restarts) instead of waiting in its exit
        barrier for the node that failed."""
        if clean and not self.stopped:
            for r in self.chans:
                if self.alive(r):
                    self.send(r, Stop())
            deadline = time.monotonic() + _STOP_SECONDS
            while any(r not in self.exitcodes for r in self.chans) and \
                    time.monotonic() < deadline:
                self.poll(min(deadline, time.monotonic() + 0.25))
        self.stopped = True
        self.relay.flush()
        for chan in self.chans.values():
            with contextlib.suppress(OSError):
                chan.close()


class ServedRanks(Ranks):
    """A `Ranks` pool whose ranks torchrun or Slurm started: see `Ranks.listen`."""

    def __init__(self, nprocs: int = 2, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 60, *, backend: str = "auto", group: bool = True,
                 output: str = "live", env: dict | None = None, token_file: str | None = None):
        self._env = check_pool(nprocs, backend, timeout, output, env)
        self.nprocs, self.backend, self.timeout = nprocs, backend, timeout
        self.group, self.output, self.start_method = group, output, "torchrun"
        self._set = None
        self._info: list[Ready] = []
        self.cells_run = 0
        self.labels: dict[str, str] = {}
        self._stopped_because = "not attached yet: call .wait_ready()"
        self.restarts = 0  # torchrun restarts so far: the highest TORCHELASTIC_RESTART_COUNT
        self._restart: _Restart | None = None  # set while torchrun restarts the workers
        self._listener = Listener(nprocs, host, port, Setup(self._env, timeout, group),
                                  token_file)
        self._finalizer = None  # set once attached: stops the ranks if the pool is dropped
        weakref.finalize(self, self._listener.shutdown)  # a pool dropped before it attached
        if not self._listener.loopback:
            print(f"ddp_helpers: listening on {self.address}, reachable from other machines: "
                  "whoever connects with the token can run code here.", flush=True)

    def __repr__(self) -> str:
        state = "attached" if self._set is not None else f"listening on {self.address}"
        return f"<{self.nprocs} served ranks, {state}>"

    @property
    def address(self) -> str:
        """host:port for `python -m ddp_helpers.serve --connect`."""
        return self._listener.address

    @property
    def token_file(self) -> str:
        """The token file (mode 0600) for `--token-file`: the ranks' host must be able to read
        it (a shared home directory on a cluster)."""
        return self._listener.token_file

    @property
    def refusals(self) -> int:
        """How many connections were turned away (no token, a wrong one, too many)."""
        return self._listener.refusals

    def connected(self) -> int:
        """How many ranks have attached so far."""
        return len(self._listener.attached)

    def command_lines(self, nnodes: int = 1) -> dict[str, str]:
        """What to paste: a torchrun line per node and an srun line, address and token filled in."""
        return command_lines(self.nprocs, self.address, self.token_file, nnodes)

    def wait_ready(self, timeout: float = 300, progress: bool = True) -> None:
        """Wait until every rank has attached and set up its process group.

        Raises:
            LaunchTimeout-like LaunchRefused: not every rank attached within `timeout`.
            RankRaised, RankDied: a rank failed while setting up.
        """
        if self._set is not None:
            return
        deadline = time.monotonic() + timeout
        if not self._gather(deadline, progress):
            raise LaunchRefused(
                f"{self.connected()} of {self.nprocs} ranks connected within {timeout:g} s "
                f"({self.refusals} connection(s) refused). Start them with:\n"
                + self.command_lines()["torchrun"])
        self._adopt(deadline)

    def _gather(self, deadline: float, progress: bool) -> bool:
        """Wait until a whole group is in the listener; False if `deadline` passes first."""
        shown = -1
        while not self._listener.full():
            n = self.connected()
            if progress and n != shown:
                print(f"{n} of {self.nprocs} ranks connected", flush=True)
                shown = n
            if time.monotonic() >= deadline:
                return False
            self._listener.wait(n + 1, min(deadline - time.monotonic(), 1.0))
        if progress:
            print(f"{self.nprocs} of {self.nprocs} ranks connected", flush=True)
        return True

    def _adopt(self, deadline: float) -> None:
        """Take the gathered group from the listener and wait for each rank's Ready."""
        self._set = ServedSet(self.nprocs, self._listener.take(), self.output)
        self._finalizer = weakref.finalize(self, self._set.shutdown)
        self.restarts = max(h.restart for h in self._set.hellos.values())
        self._info = self._request(None, list(range(self.nprocs)), max(
            deadline - time.monotonic(), 60), self.output, starting=True)
        self._stopped_because = None
        from . import ranks

        ranks._current = self

    def start(self) -> None:
        """Served ranks start under torchrun, not here: wait for them (see wait_ready)."""
        self.wait_ready()

    def restart(self) -> None:
        raise LaunchRefused("served ranks cannot be restarted from the notebook: `%ranks stop`, "
                            "then `%ranks listen N` and start the torchrun jobs again.")

    def hosts(self) -> list[Hello]:
        """Each attached rank's Hello (host, GROUP_RANK, LOCAL_RANK, pid), in rank order."""
        return [self._set.hellos[r] for r in range(self.nprocs)] if self._set else []

    def status(self) -> RanksStatus:
        """As Ranks.status, plus each rank's host, node (GROUP_RANK) and LOCAL_RANK."""
        if self._set is None:
            return ServedStatus(self.nprocs, False, self.cells_run, [],
                                self._stopped_because, hellos=[], restarts=self.restarts)
        info = self._info or [None] * self.nprocs
        rows = [RankRow(r, self._set.alive(r), h.pid, ready and ready.device,
                        ready and ready.backend)
                for (r, h), ready in zip(sorted(self._set.hellos.items()), info)]
        return ServedStatus(self.nprocs, True, self.cells_run, rows, None,
                            hellos=self.hosts(), restarts=self.restarts)

    def _failed(self, outcome, watch, timeout, starting):
        failure = self._set.failure()
        if outcome in (Outcome.TIMEOUT, Outcome.STALLED) or failure is None or failure.raised:
            return super()._failed(outcome, watch, timeout, starting)
        # A closed connection is all a served rank's death shows, and gloo aborting a rank
        # whose collective's sizes did not fit is one: where the ledgers explain it, say that,
        # once the other ranks' last lines (sent before the data that killed it, but over
        # another connection) have had a moment to arrive.
        self._set.drain_output(_LINES_GRACE_SECONDS)
        mismatch = self._mismatch(outcome, failure, watch, may_be_abort=Priority.DIED)
        if mismatch is not None:
            return mismatch
        hello, r = self._set.hellos[failure.rank], failure.rank
        last = self._set.relay.last_line(r)
        where = watch.where_all()
        consequence = self._drop(f"rank {r} on {hello.host} died, and a group cannot go on "
                                 "without a rank", where, dead=(r,))
        text = (f"rank {r} of {self.nprocs} ({_who(hello)}) closed its connection without a "
                "reply: its process died (killed, out of memory, a crash) or its node went "
                f"away. {consequence}" + (f"\nIts last line of output: {last}" if last else ""))
        return RankDied(text, rank=r, exitcode=None, signal_name=None)

    def _shutdown(self) -> None:
        if self._set is not None:
            self._finalizer.detach()
            self._set.shutdown()
        self._set = None
        self._restart = None
        self._listener.shutdown()

    def _drop(self, reason, where, *, interrupted=False, polite=True, dead=()) -> str:
        """Close every rank's connection after a failure (each exits, code 3). With restarts
        left, torchrun starts a fresh group, which the listener is already waiting for."""
        from .ranks import _where_text

        old = self.hosts()
        left = restarts_left(old)
        if self._set is not None:
            self._finalizer.detach()
            self._set.shutdown(clean=False)
            self._set = None
        # The listener may have closed already: the fresh group is in, and has no restart left.
        if left > 0 and (self._listener.listening or self._listener.full()):
            self._restart = _Restart(reason, tuple(dead), old)
            self._stopped_because = f"torchrun is restarting the workers: {reason}"
            text = (f"Every rank was stopped ({reason}){_where_text(where)}: the notebook "
                    "closed their connections, so each served rank exited (code 3), and "
                    "torchrun restarts the workers (each node's agent has at least "
                    f"{left} of its --max-restarts left). Their variables are gone; the next "
                    "cell runs on the fresh group.")
        else:
            self._shutdown()
            self._stopped_because = reason
            text = (f"Every rank was stopped ({reason}){_where_text(where)}: the notebook "
                    "closed their connections, so each served rank exited (code 3) and its "
                    "torchrun agent ended. Their variables are gone; `%ranks listen N` and "
                    "start the torchrun jobs again for a fresh group.")
        if interrupted:
            print(f"ddp_helpers: {text}", flush=True)
        return text

    def _ensure_running(self) -> None:
        if self._set is not None and self._restart is None:
            self._notice_restart()
        if self._set is not None:
            return
        if self._restart is not None:
            self._attach_restarted()
            return
        if self._stopped_because and self._stopped_because.startswith("not attached"):
            self.wait_ready()
            return
        raise LaunchRefused(f"these served ranks were stopped ({self._stopped_because}). "
                            "`%ranks listen N` and start the torchrun jobs again.")

    def _notice_restart(self) -> None:
        """Before a cell: ranks whose connections closed since the last one, while torchrun
        may restart them (its agents restart every worker when one fails): drop the group and
        let the cell run on the fresh one. Without restarts the cell reports the death."""
        if restarts_left(self.hosts()) <= 0:
            return
        self._set.drain_output()
        gone = sorted(self._set.exitcodes)
        if gone:
            ranks = ", ".join(map(str, gone))
            self._drop(f"{'rank' if len(gone) == 1 else 'ranks'} {ranks} closed the "
                       "connection between cells", {}, dead=gone)

    def _attach_restarted(self) -> None:
        """Wait for the group torchrun restarted, take it, and say what happened, once."""
        restart = self._restart
        seconds = max(self.timeout, _RESTART_SECONDS)
        deadline = time.monotonic() + seconds
        if not self._gather(deadline, progress=False):
            n = self.connected()
            self._shutdown()
            self._stopped_because = "torchrun did not restart the workers"
            raise LaunchRefused(
                f"torchrun did not restart the workers within {seconds:g} s ({n} of "
                f"{self.nprocs} reconnected; before: {restart.reason}): its agents may have "
                "run out of restarts or ended. `%ranks listen N` and start the torchrun jobs "
                "again.")
        self._restart = None
        self._adopt(deadline)
        print(restart.message(self.hosts(), self.nprocs), flush=True)


_RESTART_SECONDS = 120.0  # at least this long for torchrun to restart and reattach the workers


class _Restart:
    """What the notebook knows while torchrun restarts the workers: why the old group ended,
    which ranks died (if known) and the old group's Hellos."""

    def __init__(self, reason: str, dead: tuple[int, ...], old: list[Hello]):
        self.reason, self.dead, self.old = reason, dead, old

    def message(self, new: list[Hello], nprocs: int) -> str:
        """The one message the next cell prints: which restart, what died, what is gone."""
        count = max(h.restart for h in new)
        return (f"torchrun restarted the workers (restart {count}): {self._cause(new)}; the "
                f"{nprocs} ranks are a fresh group: variables and models defined in earlier "
                "cells are gone.")

    def _cause(self, new: list[Hello]) -> str:
        if not self.dead:
            return f"the notebook had stopped every rank ({self.reason})"
        # The nodes whose agents counted a restart are where workers failed (a node that
        # restarted only because another did keeps its count): name their closed ranks.
        before = {h.group_rank: h.restart for h in self.old}
        failed = {h.group_rank for h in new if h.restart > before.get(h.group_rank, 0)}
        by_rank = {h.rank: h for h in self.old}
        dead = [by_rank[r] for r in self.dead if by_rank[r].group_rank in failed] or \
            [by_rank[r] for r in self.dead]
        who = " and ".join(f"rank {h.rank} on {h.host} (GROUP_RANK {h.group_rank}, LOCAL_RANK "
                           f"{h.local_rank})" for h in dead)
        return (f"{who} had died (its connection closed without a reply: killed, out of "
                "memory or a crash)")


def _who(h: Hello) -> str:
    return f"host {h.host}, node GROUP_RANK {h.group_rank}, LOCAL_RANK {h.local_rank}, pid {h.pid}"


class ServedStatus(RanksStatus):
    """RanksStatus with each served rank's host, node and local rank."""

    def __init__(self, *args, hellos: list[Hello], restarts: int = 0):
        super().__init__(*args)
        self.hellos, self.restarts = hellos, restarts

    def __str__(self) -> str:
        if not self.running:
            return f"{self.nprocs} served ranks, not running ({self.stopped_because or 'stopped'})"
        head = f"{self.nprocs} served ranks attached, {self.cells_run} cells run"
        most = max((h.max_restarts for h in self.hellos), default=0)
        if most:
            head += f", torchrun restarts so far: {self.restarts} (--max-restarts {most})"
        rows = [f"  rank {r.rank}: {'alive' if r.alive else 'DEAD'}, host {h.host}, GROUP_RANK "
                f"{h.group_rank}, LOCAL_RANK {h.local_rank}, pid {h.pid}, device {r.device}"
                for r, h in zip(self.ranks, self.hellos)]
        return "\n".join([head, *rows])


def command_lines(nprocs: int, address: str, token_file: str, nnodes: int = 1) -> dict[str, str]:
    """The torchrun line (run it once per node) and the srun line (inside an allocation) that
    start `nprocs` served ranks for the notebook at `address`."""
    if nprocs % nnodes:
        raise LaunchRefused(f"{nprocs} ranks do not split evenly over {nnodes} nodes.")
    per_node = nprocs // nnodes
    serve = f"-m ddp_helpers.serve --connect {address} --token-file {token_file}"
    rdzv = ("--rdzv-backend c10d --rdzv-endpoint HEAD_NODE:29500 " if nnodes > 1 else
            "--standalone ")
    torchrun = f"torchrun --nnodes {nnodes} --nproc-per-node {per_node} {rdzv}{serve}"
    srun = (f"srun --nodes {nnodes} --ntasks-per-node 1 torchrun --nnodes {nnodes} "
            f"--nproc-per-node {per_node} --rdzv-backend c10d --rdzv-endpoint "
            '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)":29500 '
            f"{serve}")
    return {"torchrun": torchrun, "srun": srun}
