"""What runs first inside every rank process the kit forks, for `launch` and `Ranks` alike: set
the rank up as a fresh process of the caller's, then run the launched function, or serve
cells (rank.cells) until told to stop.

Kept free of the learner's code, because the start server preloads it: anything imported here
is imported once per kernel, and a learner's edits to it would not be seen.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from ..wire.channel import Channel, encode
from ..wire.messages import VERSION, Error, Ok, RunFunction, ServeCells
from .streams import flush, reopen_std_streams


@dataclass
class RankSpec:
    """Everything a rank needs from the parent, handed over once at start."""

    payload: bytes  # a pickled wire Start (RunFunction or ServeCells): unpickled here, so an
    #                 import error is reported by the rank that met it
    version: int  # the parent's protocol version (wire.messages.VERSION)
    env: dict[str, str]  # the parent's os.environ at launch time plus the rendezvous variables
    sys_path: list[str]
    cwd: str
    start_method: str | None  # the caller's multiprocessing default, for the rank's own children
    out: Any  # multiprocessing Connection (write end) that becomes fd 1
    err: Any  # ... and fd 2
    result: Any  # write end of the replies back to the parent
    lifeline: Any  # read end; EOF means the parent is gone or gave up on this run
    stacks: Any = None  # write end: faulthandler dumps every thread's stack here on SIGUSR1
    commands: Any = None  # persistent ranks only: read end of the parent's commands
    control: Any = None  # persistent ranks only: duplex, answered by a thread ("where are you?")
    ledger: Any = None  # write end: one line per collective entered (rank.link.LedgerPipe)

    def child_ends(self) -> list:
        """The connections the rank uses (the parent closes its copies once the rank has them)."""
        return [c for c in (self.out, self.err, self.result, self.lifeline, self.stacks,
                            self.commands, self.control, self.ledger) if c is not None]


def rank_entry(rank: int, specs: list[RankSpec]) -> None:
    """Set the rank up like a fresh process of the caller's, run what it was started for, and
    report back."""
    os.setsid()  # own process group: the parent stops the rank and its DataLoader workers at once
    spec = specs[rank]
    for other in specs:  # torch passes every rank the same args; keep only our own pipe ends
        if other is not spec:
            for conn in other.child_ends():
                if conn is not spec.lifeline:  # one lifeline pipe, shared by every rank
                    conn.close()
    _redirect(spec)
    _become_the_callers(spec, rank)
    _watch_lifeline(spec.lifeline)
    if spec.stacks is not None:
        # A C-level handler: it dumps the stacks even while the main thread is stuck in C++
        # code that holds the GIL, where no Python thread could run.
        faulthandler.register(signal.SIGUSR1, file=spec.stacks.fileno(), all_threads=True)
    replies = Channel(spec.result)
    try:
        if spec.version != VERSION:
            raise RuntimeError(Error.version_mismatch(spec.version).message)
        start = pickle.loads(spec.payload)
        if isinstance(start, ServeCells):
            from .cells import serve
            from .link import PipeLink

            serve(PipeLink(spec), rank, start)
            return
        reply = encode(Ok(_run(spec, start, rank)))  # an unpicklable value raises here
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        flush()
        replies.send(Error.from_exception(e))
        raise  # torch's _wrap records it too and exits with status 1
    flush()
    replies.send_encoded(reply)


def _run(spec: RankSpec, start: RunFunction, rank: int):
    """fn(rank, *args) under a tapped Ledger that feeds the parent each collective entered;
    the value on the CPU."""
    from ...ledger import Ledger  # imported here: the start server preloads this module
    from .cells import to_cpu
    from .link import LedgerPipe

    with Ledger(on_call=LedgerPipe(spec.ledger.fileno()), tap=True):
        return to_cpu(start.fn(rank, *start.args))


def _become_the_callers(spec: RankSpec, rank: int) -> None:
    """The caller's environment, sys.path, working directory and start method."""
    os.environ.clear()
    os.environ.update(spec.env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    _reread_torch_env()
    # A forkserver child inherits "forkserver" as its default start method; DataLoader workers
    # would then wait seconds for a new server. Give the rank the caller's default instead.
    multiprocessing.set_start_method(spec.start_method, force=True)
    sys.path[:] = spec.sys_path
    os.chdir(spec.cwd)


def _reread_torch_env() -> None:
    """torch.distributed read TORCH_DISTRIBUTED_DEBUG when the start server imported it, before
    this rank's environment existed: read it again so env={...} given to launch takes effect."""
    import torch.distributed as dist

    if dist.is_available():
        dist.set_debug_level_from_env()


def _redirect(spec: RankSpec) -> None:
    """Point fds 1 and 2 (Python's and C++'s output alike) at pipes the parent relays."""
    os.dup2(spec.out.fileno(), 1)
    os.dup2(spec.err.fileno(), 2)
    reopen_std_streams()
    spec.out.close()
    spec.err.close()


def _watch_lifeline(lifeline) -> None:
    """Stop this rank (and its workers) when the parent closes the lifeline or dies."""

    def watch() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="ddp_helpers-lifeline", daemon=True).start()
