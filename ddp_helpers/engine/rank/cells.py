"""The cell server: set a persistent rank up once, then run the parent's cells in one namespace
that lives as long as the rank, over whichever link reached it (rank.link: pipes for ranks the
kit forked, a socket for ranks torchrun started).

A cell is compiled under the name "<cell N>" (N: the pool's count, unique, which linecache and
inspect need) and registered with linecache, so tracebacks show the learner's own lines; the
parent names the cell as the learner knows it ("In [5]"). The value of its last expression is
sent back, as IPython would display it.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import threading
import traceback
import types

import torch
import torch.distributed as dist
from torch import nn

from ...ledger import Ledger
from ...runtime import BACKEND_VAR, choose_backend, let_gloo_threads_finish, process_group
from ..wire.channel import Unreadable, encode
from ..wire.messages import (
    Debug,
    DebugLine,
    Error,
    Ok,
    Push,
    Ready,
    RunCell,
    ServeCells,
    Stop,
    Summarise,
)
from .debugger import post_mortem
from .stacks import CELL_PREFIX
from .streams import flush
from .summaries import summaries


class Kept:
    """What the rank keeps between cells besides its namespace: the exception of its last
    failing cell (and so that cell's frames and their variables), for post-mortem."""

    def __init__(self):
        self.failure: BaseException | None = None

    def describe(self) -> str:
        """"ValueError: loss is NaN" (what %ranks where says the rank keeps), or ""."""
        if self.failure is None:
            return ""
        first = (str(self.failure).splitlines() or [""])[0]
        return f"{type(self.failure).__name__}: {first}"


def serve(link, rank: int, cells: ServeCells, extra: dict | None = None) -> None:
    """Set up this rank (with the default process group unless cells.group is False), reply
    Ready, then run the parent's commands until Stop; always tear the group down. The backend
    comes from the environment (runtime.BACKEND_VAR), as it does for a launched function.
    `extra` adds names to the namespace (a served rank's local_rank, group_rank, host)."""
    namespace = new_namespace(rank, cells.world_size)
    namespace.update(extra or {})
    kept = Kept()
    link.start(threading.get_ident(), kept)
    if cells.group:
        with process_group(rank, cells.world_size, timeout_s=cells.timeout) as device:
            namespace["device"] = device
            _loop(link, namespace, kept)
        return
    namespace["device"] = _device_without_group(cells.world_size, rank)
    try:
        _loop(link, namespace, kept)
    finally:  # the learner's own group, if they made one
        if dist.is_available() and dist.is_initialized():
            let_gloo_threads_finish()  # the learner's cells may have run Python comm hooks
            dist.destroy_process_group()


def _device_without_group(world_size: int, rank: int) -> torch.device:
    """The device process_group would have chosen, for ranks that make their own group."""
    if choose_backend(os.environ.get(BACKEND_VAR, "auto"), world_size)[1] != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())


def new_namespace(rank: int, world_size: int) -> dict:
    """A fresh module standing in for __main__, as IPython's user namespace does, so functions
    and classes defined in cells can be pickled by reference on this rank."""
    module = types.ModuleType("__main__")
    module.__dict__.update(rank=rank, world_size=world_size, torch=torch, dist=dist, nn=nn)
    sys.modules["__main__"] = module
    return module.__dict__


def _loop(link, namespace: dict, kept: Kept) -> None:
    link.send(_ready(namespace))
    pending = None  # a command that arrived while pdb waited for a line (it ended pdb)
    while True:
        try:
            command, pending = pending or link.recv(), None
        except (EOFError, OSError):
            return  # the parent is gone
        except Unreadable as e:  # a value this rank cannot rebuild: say so, and stay up
            link.send(Error.from_exception(e.cause, traceback=""))
            continue
        if isinstance(command, Stop):
            return
        if isinstance(command, Debug):
            left = post_mortem(link, kept.failure)
            pending = left if isinstance(left, (Stop, RunCell, Push, Summarise)) else None
            continue
        if isinstance(command, DebugLine):
            continue  # a line for a pdb session that has ended
        reply = _reply(command, namespace, kept, link)
        flush()
        link.send_encoded(reply)


def _reply(command, namespace: dict, kept: Kept, link) -> bytes:
    """The encoded reply to a cell, a push or a summary request."""
    if isinstance(command, RunCell):
        reply, failure = run_cell(namespace, command, link.feed_ledger)
        if failure is not None:
            kept.failure = failure
        return reply
    if isinstance(command, Summarise):
        try:
            return encode(Ok(summaries(namespace, command.expressions, command.chunk)))
        except Exception as e:  # noqa: BLE001 - a summary that cannot be made or sent
            return encode(Error.from_exception(e))
    assert isinstance(command, Push), command
    namespace.update(command.values)
    return encode(Ok())


def _ready(namespace: dict) -> Ready:
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return Ready(pid=os.getpid(), device=str(namespace["device"]), backend=backend)


def run_cell(namespace: dict, cell: RunCell, feed_ledger) -> tuple[bytes, BaseException | None]:
    """Run one cell under a tapped ledger that tells the parent each collective it enters;
    its reply, encoded (Ok(last value, {name: value}) or Error), and the exception it raised."""
    filename = f"{CELL_PREFIX}{cell.number}>"
    code = "\n" * (cell.first_line - 1) + cell.code  # lines numbered as the editor shows them
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        with Ledger(on_call=feed_ledger, tap=True):
            value = _execute(code, filename, namespace)
        returned = {n: _lookup(namespace, n) for n in cell.returns}
        return _encode_ok(value, returned), None
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the rank must stay up
        return encode(Error.from_exception(e, traceback=_cell_traceback(e))), e


def _execute(code: str, filename: str, namespace: dict):
    """exec the cell; if it ends with an expression, evaluate that and return its value."""
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)


def _lookup(namespace: dict, name: str):
    if name not in namespace:
        raise NameError(f"--return {name}: no variable {name!r} on rank "
                        f"{namespace['rank']} after this cell")
    return namespace[name]


def _encode_ok(value, returned: dict) -> bytes:
    try:
        return encode(Ok(to_cpu(value), to_cpu(returned)))
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported the same way
        what = type(value).__name__ if not returned else "a returned variable"
        raise TypeError(f"the cell ran, but its value ({what}) cannot be sent back to the "
                        f"notebook: {type(e).__name__}: {e}. End the cell with plain data "
                        "(numbers, lists, dicts, tensors) or with a statement, which has no "
                        "value.") from None


def _cell_traceback(e: BaseException) -> str:
    """The traceback from the cell's own frame on: the kit's frames above it are plumbing."""
    tb = e.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
        tb = tb.tb_next
    if tb is None:  # a SyntaxError: raised before any cell frame ran
        return "".join(traceback.format_exception_only(type(e), e))
    return "".join(traceback.format_exception(type(e), e, tb))


def to_cpu(value):
    """Returned tensors moved to the CPU, so unpickling them never touches CUDA in the kernel."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    return value
