"""Rank side of persistent ranks (`dh.Ranks`, `%%ranks`): set up once, then run the parent's
cells in one namespace that lives as long as the rank.

Preloaded by the start server like rank_entry.py, so it stays free of the learner's code. A cell is
compiled under the name "<cell N>" and registered with linecache, so tracebacks show the
learner's own lines; the value of its last expression is sent back, as IPython would display it.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import sys
import threading
import traceback
import types

import torch
import torch.distributed as dist
from torch import nn

from ..ledger import Ledger
from ..runtime import BACKEND_VAR, choose_backend, let_gloo_threads_finish, process_group
from .ledger_feed import feed
from .protocol import (
    AskWhere,
    Channel,
    Error,
    Ok,
    Push,
    Ready,
    RunCell,
    Stop,
    Unreadable,
    Where,
    encode,
)
from .rank_entry import current_spec, flush, to_cpu

# Where a stuck main thread waits on its peers: frames in these parts of torch. Backward counts
# because DDP's reducer waits for its bucket all-reduces at the end of backward.
_COMM_PATHS = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
_CELL = "<cell "
_LABELS: dict[str, str] = {}  # "<cell 12>" -> "In [5]", for each cell the magic named


def serve(rank: int, world_size: int, group: bool, timeout_s: float) -> None:
    """Set up this rank (with the default process group unless `group` is False), tell the
    parent it is Ready, then run its commands until told to Stop. The backend comes from the
    environment (runtime.BACKEND_VAR), as it does for a launched function."""
    spec = current_spec()
    commands, replies = Channel(spec.commands), Channel(spec.result)
    namespace = _namespace(rank, world_size)
    _answer_questions(Channel(spec.control), threading.get_ident())
    if group:
        with process_group(rank, world_size, timeout_s=timeout_s) as device:
            namespace["device"] = device
            _loop(commands, replies, namespace)
        return
    namespace["device"] = _device_without_group(world_size, rank)
    try:
        _loop(commands, replies, namespace)
    finally:  # the learner's own group, if they made one
        if dist.is_available() and dist.is_initialized():
            let_gloo_threads_finish()  # the learner's cells may have run Python comm hooks
            dist.destroy_process_group()


def _device_without_group(world_size: int, rank: int) -> torch.device:
    """The device process_group would have chosen, for ranks that make their own group."""
    if choose_backend(os.environ.get(BACKEND_VAR, "auto"), world_size)[1] != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())


def _namespace(rank: int, world_size: int) -> dict:
    """A fresh module standing in for __main__, as IPython's user namespace does, so functions
    and classes defined in cells can be pickled by reference on this rank."""
    module = types.ModuleType("__main__")
    module.__dict__.update(rank=rank, world_size=world_size, torch=torch, dist=dist, nn=nn)
    sys.modules["__main__"] = module
    return module.__dict__


def _loop(commands: Channel, replies: Channel, namespace: dict) -> None:
    replies.send(_ready(namespace))
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        except Unreadable as e:  # a value this rank cannot rebuild: say so, and stay up
            replies.send(Error.from_exception(e.cause, traceback=""))
            continue
        if isinstance(command, Stop):
            return
        if isinstance(command, RunCell):
            reply = run_cell(namespace, command)
        else:
            assert isinstance(command, Push), command
            namespace.update(command.values)
            reply = encode(Ok())
        flush()
        replies.send_encoded(reply)


def _ready(namespace: dict) -> Ready:
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return Ready(pid=os.getpid(), device=str(namespace["device"]), backend=backend)


def run_cell(namespace: dict, cell: RunCell) -> bytes:
    """Run one cell; its reply, encoded: Ok(last value, {name: value}) or Error."""
    # The code runs as "<cell 12>" (the pool's count: unique, which linecache and inspect
    # need, even where a batch runner gives every cell the same In [N]); messages and
    # tracebacks show the learner's name for it, "In [5]".
    filename = f"{_CELL}{cell.number}>"
    if cell.label:
        _LABELS[filename] = cell.label
    code = "\n" * (cell.first_line - 1) + cell.code  # lines numbered as the editor shows them
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        with Ledger(on_call=feed(), tap=True):  # the parent learns each collective entered
            value = _execute(code, filename, namespace)
        returned = {n: _lookup(namespace, n) for n in cell.returns}
        return _encode_ok(value, returned)
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the rank must stay up
        return encode(Error.from_exception(e, traceback=_cell_traceback(e)))


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
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(_CELL):
        tb = tb.tb_next
    if tb is None:  # a SyntaxError: raised before any cell frame ran
        return _named("".join(traceback.format_exception_only(type(e), e)))
    return _named("".join(traceback.format_exception(type(e), e, tb)))


def _named(text: str) -> str:
    """A traceback with each cell's file shown by the learner's name: "<cell In [5]>"."""
    return re.sub(r'"(<cell \d+>)"',
                  lambda m: f'"<cell {_LABELS[m[1]]}>"' if m[1] in _LABELS else m[0], text)


def _answer_questions(control: Channel, main_thread: int) -> None:
    """Answer the parent's AskWhere from a thread: the main thread may be blocked in a
    collective (which releases the GIL), and the parent wants to say where."""

    def answer() -> None:
        while True:
            try:
                question = control.recv()
                if isinstance(question, AskWhere):
                    control.send(where(main_thread))
            except Unreadable:
                continue  # a message this rank cannot rebuild: the next question still counts
            except (EOFError, OSError):
                return

    threading.Thread(target=answer, name="ddp_helpers-control", daemon=True).start()


def where(thread_id: int) -> Where:
    """Where a thread is: idle (waiting for a cell), or its cell line and torch call."""
    frame = sys._current_frames().get(thread_id)
    stack = traceback.extract_stack(frame) if frame is not None else []
    cells = [f for f in stack if f.filename.startswith(_CELL)]
    if not cells:
        return Where(idle=True)
    inside = [f for f in stack[stack.index(cells[-1]) + 1:]
              if any(p in f.filename.replace(os.sep, "/") for p in _COMM_PATHS)]
    calls = [f.name for f in inside if f.name not in ("wrapper", "<module>")]
    line = cells[-1]
    return Where(in_comm=bool(inside) or ".wait(" in (line.line or ""),
                 cell=f"{cell_name(line.filename)}, line {line.lineno}: "
                      f"{(line.line or '').strip()}",
                 call=calls[-1] if calls else None)


def cell_name(filename: str, labels: dict[str, str] | None = None) -> str:
    """The learner's name of the cell run as `filename`: "In [5]" where the magic gave that
    label (in `labels`, else this rank's), "this cell" for code run from Python (its number is
    the pool's count, which the learner never sees)."""
    return (_LABELS if labels is None else labels).get(filename, "this cell")
