"""How a pool gets its ranks, and what happens after it loses them: `Fork` forks them from the
kit's start server; `Listen` lets in the ranks torchrun or Slurm starts (`Ranks.listen`), and
takes the fresh group that `torchrun --max-restarts` starts after a failure. The pool
(ranks.Ranks) calls these; they hand it a rank set (engine/sets) and say, after a failure,
what comes next (words.failures.Stopped)."""

from __future__ import annotations

import time
import weakref

from .options import start_line
from .sets.attached import AttachedSet
from .sets.forked import ForkedSet
from .sets.listener import Listener
from .sets.start import free_port
from .wire.messages import Hello, ServeCells, Setup, restarts_left
from .words.errors import LaunchRefused
from .words.failures import Next, Stopped

_START_TIMEOUT = 120.0  # a cold start (the start server imports torch) takes a few seconds
_RESTART_SECONDS = 120.0  # at least this long for torchrun to restart and reattach the workers


class Fork:
    """Ranks the kit forks itself: started at once, and started afresh at the next cell after
    a failure stopped them."""

    kind = "ranks"
    starts_at_once = True
    restarts = 0

    def __init__(self, start_method: str):
        self.start_method = start_method

    def prepare(self, pool) -> None:
        pass

    def describe(self, pool) -> str:
        return "ranks, running" if pool.running else "ranks, not running"

    def start(self, pool) -> None:
        ranks = ForkedSet(pool.nprocs, self.start_method, persistent=True, output=pool.output)
        try:
            ranks.start(ServeCells(pool.nprocs, pool.group, pool.timeout), pool._env,
                        free_port())
        except BaseException:
            ranks.shutdown(polite=False)
            raise
        pool.attach(ranks, _START_TIMEOUT)

    def before_cell(self, pool) -> None:
        if pool.running:
            return
        if pool.stopped_because == "stopped":
            raise LaunchRefused(f"these ranks were stopped: start fresh ones with "
                                f"{start_line(pool.nprocs, pool.backend)} (in Python: "
                                "pool.restart()).")
        print(f"starting {pool.nprocs} fresh ranks (the previous ones were stopped: "
              f"{pool.stopped_because})", flush=True)
        pool.start()

    def drop(self, pool, reason: str, dead: tuple[int, ...], polite: bool) -> Stopped:
        pool._shutdown(polite=polite)
        pool.stopped_because = reason
        return Stopped(reason, Next.FRESH_GROUP)

    def check_restart(self) -> None:
        pass

    def close(self) -> None:
        pass

    def hellos(self, pool) -> list[Hello] | None:
        return None

    def who(self, pool):
        return None

    def host(self, pool):
        return None

    def listening(self, pool):
        raise LaunchRefused("these ranks were forked by the kit: only a pool made with "
                            "dh.Ranks.listen(...) (`%ranks listen N`) has an address, a token "
                            "file and torchrun command lines.")

    def command_lines(self, pool, nnodes: int):
        self.listening(pool)

    def wait_ready(self, pool, timeout: float, progress: bool) -> None:
        pool.start()


class Listen:
    """Ranks torchrun or srun starts elsewhere, let in by a Listener (token-checked). Under
    `torchrun --max-restarts K` a failed group is followed by a fresh one: the listener keeps
    its port open for it, and the next cell takes it and says once that the old one's
    variables are gone."""

    kind = "served ranks"
    starts_at_once = False
    start_method = "torchrun"

    def __init__(self, host: str, port: int, token_file: str | None):
        self.host_address, self.port, self.token_file = host, port, token_file
        self.listener: Listener | None = None
        self.restarts = 0  # torchrun restarts so far: the highest TORCHELASTIC_RESTART_COUNT
        self._restart: _Restart | None = None  # set while torchrun restarts the workers

    def prepare(self, pool) -> None:
        self.listener = Listener(pool.nprocs, self.host_address, self.port,
                                 Setup(pool._env, pool.timeout, pool.group), self.token_file)
        weakref.finalize(pool, self.listener.shutdown)  # a pool dropped before it attached
        pool.stopped_because = "not attached yet: call .wait_ready()"
        if not self.listener.loopback:
            print(f"ddp_helpers: listening on {self.listener.address}, reachable from other "
                  "machines: whoever connects with the token can run code here.", flush=True)

    def describe(self, pool) -> str:
        state = "attached" if pool.running else f"listening on {self.listener.address}"
        return f"served ranks, {state}"

    def listening(self, pool) -> Listener:
        return self.listener

    def command_lines(self, pool, nnodes: int = 1) -> dict[str, str]:
        return command_lines(pool.nprocs, self.listener.address, self.listener.token_file,
                             nnodes)

    def start(self, pool) -> None:
        """Served ranks start under torchrun, not here: wait for them."""
        self.wait_ready(pool, 300, True)

    def wait_ready(self, pool, timeout: float, progress: bool) -> None:
        if pool.running:
            return
        deadline = time.monotonic() + timeout
        if not self._gather(pool, deadline, progress):
            raise LaunchRefused(
                f"{len(self.listener.attached)} of {pool.nprocs} ranks connected within "
                f"{timeout:g} s ({self.listener.refusals} connection(s) refused). Start them "
                "with:\n" + self.command_lines(pool)["torchrun"])
        self._adopt(pool, deadline)

    def _gather(self, pool, deadline: float, progress: bool) -> bool:
        """Wait until a whole group is in the listener; False if `deadline` passes first."""
        shown = -1
        while not self.listener.full():
            n = len(self.listener.attached)
            if progress and n != shown:
                print(f"{n} of {pool.nprocs} ranks connected", flush=True)
                shown = n
            if time.monotonic() >= deadline:
                return False
            self.listener.wait(n + 1, min(deadline - time.monotonic(), 1.0))
        if progress:
            print(f"{pool.nprocs} of {pool.nprocs} ranks connected", flush=True)
        return True

    def _adopt(self, pool, deadline: float) -> None:
        """Take the gathered group from the listener and wait for each rank's Ready."""
        ranks = AttachedSet(pool.nprocs, self.listener.take(), pool.output)
        self.restarts = max(h.restart for h in ranks.hellos.values())
        pool.attach(ranks, max(deadline - time.monotonic(), 60))

    def before_cell(self, pool) -> None:
        if pool.running and self._restart is None:
            self._notice_restart(pool)
        if pool.running:
            return
        if self._restart is not None:
            self._attach_restarted(pool)
            return
        if pool.stopped_because and pool.stopped_because.startswith("not attached"):
            self.wait_ready(pool, 300, True)
            return
        raise LaunchRefused(f"these served ranks were stopped ({pool.stopped_because}). "
                            "`%ranks listen N` and start the torchrun jobs again.")

    def _notice_restart(self, pool) -> None:
        """Before a cell: ranks whose connections closed since the last one, while torchrun
        may restart them (its agents restart every worker when one fails): drop the group and
        let the cell run on the fresh one. Without restarts the cell reports the death."""
        if restarts_left(self.hellos(pool)) <= 0:
            return
        pool._set.drain_output()
        gone = sorted(pool._set.exitcodes)
        if gone:
            ranks = ", ".join(map(str, gone))
            self.drop(pool, f"{'rank' if len(gone) == 1 else 'ranks'} {ranks} closed the "
                      "connection between cells", tuple(gone), polite=False)

    def _attach_restarted(self, pool) -> None:
        """Wait for the group torchrun restarted, take it, and say what happened, once."""
        restart = self._restart
        seconds = max(pool.timeout, _RESTART_SECONDS)
        deadline = time.monotonic() + seconds
        if not self._gather(pool, deadline, progress=False):
            n = len(self.listener.attached)
            self.close()
            pool.stopped_because = "torchrun did not restart the workers"
            raise LaunchRefused(
                f"torchrun did not restart the workers within {seconds:g} s ({n} of "
                f"{pool.nprocs} reconnected; before: {restart.reason}): its agents may have "
                "run out of restarts or ended. `%ranks listen N` and start the torchrun jobs "
                "again.")
        self._restart = None
        self._adopt(pool, deadline)
        print(restart.message(self.hellos(pool), pool.nprocs), flush=True)

    def drop(self, pool, reason: str, dead: tuple[int, ...], polite: bool) -> Stopped:
        """Close every rank's connection after a failure (each exits, code 3). With restarts
        left, torchrun starts a fresh group, which the listener is already waiting for."""
        old = self.hellos(pool) or []
        left = restarts_left(old)
        pool._shutdown(polite=False)
        # The listener may have closed already: the fresh group is in, and has no restart left.
        if left > 0 and (self.listener.listening or self.listener.full()):
            self._restart = _Restart(reason, dead, old)
            pool.stopped_because = f"torchrun is restarting the workers: {reason}"
            return Stopped(reason, Next.TORCHRUN_RESTARTS, left)
        self.close()
        pool.stopped_because = reason
        return Stopped(reason, Next.SERVED_ENDED)

    def check_restart(self) -> None:
        raise LaunchRefused("served ranks cannot be restarted from the notebook: `%ranks stop`, "
                            "then `%ranks listen N` and start the torchrun jobs again.")

    def close(self) -> None:
        self._restart = None
        self.listener.shutdown()

    def hellos(self, pool) -> list[Hello] | None:
        ranks = pool._set
        return [ranks.hellos[r] for r in range(pool.nprocs)] if ranks is not None else None

    def who(self, pool):
        """A served rank as the words name it: host, node, local rank, pid."""
        hellos = self.hellos(pool) or []
        return lambda r: (f"host {hellos[r].host}, GROUP_RANK {hellos[r].group_rank}, "
                          f"LOCAL_RANK {hellos[r].local_rank}, pid {hellos[r].pid}")

    def host(self, pool):
        hellos = self.hellos(pool) or []
        return lambda r: hellos[r].host


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
