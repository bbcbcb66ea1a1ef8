"""What runs first inside every rank process the kit starts, for `launch` and `Ranks` alike.

Kept tiny and free of the learner's code, because the start server preloads it: anything
imported here is imported once per kernel, and a learner's edits to it would not be seen.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .protocol import Channel, Error, Ok, encode


@dataclass
class RankSpec:
    """Everything a rank needs from the parent, sent once at start."""

    payload: bytes  # pickle of (fn, args): unpickled here so import errors are reported per rank
    env: dict[str, str]  # the parent's os.environ at launch time plus the rendezvous variables
    sys_path: list[str]
    cwd: str
    start_method: str | None  # the caller's multiprocessing default, for the rank's own children
    out: Any  # multiprocessing Connection (write end) that becomes fd 1
    err: Any  # ... and fd 2
    result: Any  # write end of the replies (protocol.Ok, Ready, Error) back to the parent
    lifeline: Any  # read end; EOF means the parent is gone or gave up on this run
    stacks: Any = None  # write end: faulthandler dumps every thread's stack here on SIGUSR1
    commands: Any = None  # persistent ranks only: read end of the parent's commands
    control: Any = None  # persistent ranks only: duplex, answered by a thread ("where are you?")
    ledger: Any = None  # write end: one line per collective entered (ledger_feed.Feed)

    def child_ends(self) -> list:
        """The connections the rank uses (the parent closes its copies once the rank has them)."""
        return [c for c in (self.out, self.err, self.result, self.lifeline, self.stacks,
                            self.commands, self.control, self.ledger) if c is not None]


_current: RankSpec | None = None


def current_spec() -> RankSpec:
    """This rank's spec: persistent ranks read their command and control pipes from it."""
    if _current is None:
        raise RuntimeError("current_spec() is only available inside a rank started by the kit")
    return _current


def rank_entry(rank: int, specs: list[RankSpec]) -> None:
    """Set the rank up like a fresh process of the caller's, run fn(rank, *args), report back."""
    global _current
    os.setsid()  # own process group: the parent stops the rank and its DataLoader workers at once
    spec = _current = specs[rank]
    for other in specs:  # torch passes every rank the same args; keep only our own pipe ends
        if other is not spec:
            for conn in other.child_ends():
                if conn is not spec.lifeline:  # one lifeline pipe, shared by every rank
                    conn.close()
    _redirect(spec)
    os.environ.clear()
    os.environ.update(spec.env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    _reread_torch_env()
    # A forkserver child inherits "forkserver" as its default start method; DataLoader workers
    # would then wait seconds for a new server. Give the rank the caller's default instead.
    multiprocessing.set_start_method(spec.start_method, force=True)
    sys.path[:] = spec.sys_path
    os.chdir(spec.cwd)
    _watch_lifeline(spec.lifeline)
    if spec.stacks is not None:
        # A C-level handler: it dumps the stacks even while the main thread is stuck in C++
        # code that holds the GIL, where no Python thread could run.
        faulthandler.register(signal.SIGUSR1, file=spec.stacks.fileno(), all_threads=True)
    replies = Channel(spec.result)
    try:
        fn, args = pickle.loads(spec.payload)
        reply = encode(Ok(to_cpu(_run(spec, fn, rank, args))))  # unpicklable values raise here
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        flush()
        replies.send(Error.from_exception(e))
        raise  # torch's _wrap records it too and exits with status 1
    flush()
    replies.send_encoded(reply)


def _run(spec: RankSpec, fn, rank: int, args: tuple):
    """fn(rank, *args), under a tapped Ledger that feeds the parent each collective entered
    (persistent ranks run cells under their own, one per cell)."""
    if spec.commands is not None or spec.ledger is None:
        return fn(rank, *args)
    from ..ledger import Ledger  # imported here: the start server preloads this module
    from .ledger_feed import feed

    with Ledger(on_call=feed(), tap=True):
        return fn(rank, *args)


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
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
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


def flush() -> None:
    """Push out what Python and C stdio still buffer, so it reaches the parent before the
    report does (C++ code printing through printf is block-buffered on a pipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def to_cpu(value):
    """Move returned tensors to the CPU, so unpickling them never touches CUDA in the kernel."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    return value
