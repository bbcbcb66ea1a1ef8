"""Rank side of persistent ranks (`dh.Ranks`, `%%ranks`): set up once, then run the parent's
cells in one namespace that lives as long as the rank.

Preloaded by the start server like _rank.py, so it stays free of the learner's code. A cell is
compiled under the name "<cell N>" and registered with linecache, so tracebacks show the
learner's own lines; the value of its last expression is sent back, as IPython would display it.
"""

from __future__ import annotations

import ast
import linecache
import os
import pickle
import sys
import threading
import traceback
import types

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import choose_backend, let_gloo_threads_finish, process_group
from .rank_entry import current_spec, flush, to_cpu

# Where a stuck main thread waits on its peers: frames in these parts of torch. Backward counts
# because DDP's reducer waits for its bucket all-reduces at the end of backward.
_COMM_PATHS = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
_CELL = "<cell "


def serve(rank: int, world_size: int, group: bool, backend: str, timeout_s: float) -> None:
    """Set up this rank (with the default process group unless `group` is False), greet the
    parent, then run its commands until told to stop."""
    spec = current_spec()
    namespace = _namespace(rank, world_size)
    _answer_questions(spec.control, threading.get_ident())
    if group:
        with process_group(rank, world_size, backend=backend, timeout_s=timeout_s) as device:
            namespace["device"] = device
            _loop(spec, namespace)
        return
    namespace["device"] = _device_without_group(backend, world_size, rank)
    try:
        _loop(spec, namespace)
    finally:  # the learner's own group, if they made one
        if dist.is_available() and dist.is_initialized():
            let_gloo_threads_finish()  # the learner's cells may have run Python comm hooks
            dist.destroy_process_group()


def _device_without_group(backend: str, world_size: int, rank: int) -> torch.device:
    """The device process_group would have chosen, for ranks that make their own group."""
    if choose_backend(backend, world_size)[1] != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())


def _namespace(rank: int, world_size: int) -> dict:
    """A fresh module standing in for __main__, as IPython's user namespace does, so functions
    and classes defined in cells can be pickled by reference on this rank."""
    module = types.ModuleType("__main__")
    module.__dict__.update(rank=rank, world_size=world_size, torch=torch, dist=dist, nn=nn)
    sys.modules["__main__"] = module
    return module.__dict__


def _loop(spec, namespace: dict) -> None:
    spec.result.send_bytes(pickle.dumps(("ok", _greeting(namespace))))
    while True:
        try:
            data = spec.commands.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            message = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - a value this rank cannot rebuild: say so, stay up
            spec.result.send_bytes(pickle.dumps(("error", type(e).__qualname__, str(e), "")))
            continue
        if message[0] == "stop":
            return
        if message[0] == "run":
            reply = run_cell(namespace, *message[1:])
        else:  # ("push", {name: value})
            namespace.update(message[1])
            reply = pickle.dumps(("ok", None))
        flush()
        spec.result.send_bytes(reply)


def _greeting(namespace: dict) -> dict:
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return {"pid": os.getpid(), "device": str(namespace["device"]), "backend": backend}


def run_cell(namespace: dict, number: int, code: str, names: list[str]) -> bytes:
    """Run one cell; the pickled ("ok", (last value, {name: value})) or ("error", ...) reply."""
    filename = f"{_CELL}{number}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        value = _execute(code, filename, namespace)
        returned = {n: _lookup(namespace, n) for n in names}
        return _reply_ok(value, returned)
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the rank must stay up
        return pickle.dumps(("error", type(e).__qualname__, str(e), _cell_traceback(e)))


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


def _reply_ok(value, returned: dict) -> bytes:
    try:
        return pickle.dumps(("ok", to_cpu((value, returned))))
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
        return "".join(traceback.format_exception_only(type(e), e))
    return "".join(traceback.format_exception(type(e), e, tb))


def _answer_questions(control, main_thread: int) -> None:
    """Answer the parent's "where are you?" from a thread: the main thread may be blocked in a
    collective (which releases the GIL), and the parent wants to say where."""

    def answer() -> None:
        while True:
            try:
                control.recv()
                control.send(where(main_thread))
            except (EOFError, OSError):
                return

    threading.Thread(target=answer, name="ddp_helpers-control", daemon=True).start()


def where(thread_id: int) -> dict:
    """Where a thread is: idle (waiting for a cell), or its cell line and torch call."""
    frame = sys._current_frames().get(thread_id)
    stack = traceback.extract_stack(frame) if frame is not None else []
    cells = [f for f in stack if f.filename.startswith(_CELL)]
    if not cells:
        return {"idle": True, "in_comm": False, "cell": None, "call": None}
    inside = [f for f in stack[stack.index(cells[-1]) + 1:]
              if any(p in f.filename.replace(os.sep, "/") for p in _COMM_PATHS)]
    calls = [f.name for f in inside if f.name not in ("wrapper", "<module>")]
    line = cells[-1]
    return {"idle": False,
            "in_comm": bool(inside) or ".wait(" in (line.line or ""),
            "cell": f"{line.filename} line {line.lineno}: {(line.line or '').strip()}",
            "call": calls[-1] if calls else None}
