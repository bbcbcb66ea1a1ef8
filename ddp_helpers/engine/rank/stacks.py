"""Where a rank's main thread is, asked from another thread of the rank (its control thread):
the main thread may be blocked in a collective, which releases the GIL, and the parent wants
to say where, or keep a snapshot of its frames before it stops the ranks. What the parent asks
arrives as a wire question; `answer` answers it."""

from __future__ import annotations

import os
import reprlib
import sys
import sysconfig
import traceback
import types

from ..wire.messages import AskStack, AskWhere, Frame, FrameLocals, Stack, Value, Where

CELL_PREFIX = "<cell "  # cells run as "<cell N>" (rank.cells)
# Where a stuck main thread waits on its peers: frames in these parts of torch. Backward counts
# because DDP's reducer waits for its bucket all-reduces at the end of backward.
_COMM_PATHS = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
# Frames that are not the learner's: the engine's own, and the standard library's and installed
# packages' (torch's among them); the kit's lessons and the learner's own files are kept.
_ENGINE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARIES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "purelib", "platlib")})
_KIT = os.sep + "ddp_helpers" + os.sep
_MAX_VALUES = 12  # locals shown per frame
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 60, 60, 6, 4


def answer(question, main_thread: int, failure: str = ""):
    """The answer to a parent's question about the thread `main_thread`; `failure` names the
    exception this rank keeps for post-mortem, if any."""
    if isinstance(question, AskWhere):
        return where(main_thread)
    if isinstance(question, AskStack):
        return stack(main_thread, failure)
    raise TypeError(f"not a question: {type(question).__name__}")


def where(thread_id: int) -> Where:
    """Where a thread is: idle (waiting for a cell), or its cell line and torch call."""
    frame = sys._current_frames().get(thread_id)
    stack = traceback.extract_stack(frame) if frame is not None else []
    cells = [f for f in stack if f.filename.startswith(CELL_PREFIX)]
    if not cells:
        return Where(idle=True)
    inside = [f for f in stack[stack.index(cells[-1]) + 1:]
              if any(p in f.filename.replace(os.sep, "/") for p in _COMM_PATHS)]
    calls = [f.name for f in inside if f.name not in ("wrapper", "<module>")]
    line = cells[-1]
    text = (line.line or "").strip()
    return Where(in_comm=bool(inside) or ".wait(" in text,
                 frame=Frame(line.filename, line.lineno, line.name, text),
                 call=calls[-1] if calls else None)


def stack(thread_id: int, failure: str = "") -> Stack:
    """A thread's stack: the learner's frames with their locals summarised, outermost first,
    and the torch call it sits in with the tensors handed to it."""
    frame = sys._current_frames().get(thread_id)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    cells = [i for i, f in enumerate(frames) if f.f_code.co_filename.startswith(CELL_PREFIX)]
    if not cells:
        return Stack(idle=True, failure=failure)
    theirs = [f for f in frames[cells[0]:] if _is_theirs(f.f_code.co_filename)]
    below = frames[frames.index(theirs[-1]) + 1:]
    comm = [f for f in below if any(p in f.f_code.co_filename.replace(os.sep, "/")
                                    for p in _COMM_PATHS)]
    named = [f for f in comm if f.f_code.co_name not in ("wrapper", "<module>")]
    calls = [f.f_code.co_name for f in named]
    handed = _tensor_values(named[0]) if named else ()  # the call the learner's line made
    last = theirs[-1]
    text = _source_line(last)
    return Stack(idle=False, frames=tuple(FrameLocals(_frame(f), _locals(f)) for f in theirs),
                 call=calls[0] if calls else None, call_values=handed,
                 in_comm=bool(comm) or ".wait(" in text, failure=failure)


def frame_locals(frame: types.FrameType) -> FrameLocals:
    """One frame with its locals summarised (also for a kept failure's frames)."""
    return FrameLocals(_frame(frame), _locals(frame))


def _is_theirs(path: str) -> bool:
    if path.startswith(CELL_PREFIX):
        return True
    if path.startswith(_ENGINE) or path.startswith("<"):
        return False
    return _KIT in path or not path.startswith(_LIBRARIES)


def _frame(f: types.FrameType) -> Frame:
    return Frame(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, _source_line(f))


def _source_line(f: types.FrameType) -> str:
    import linecache

    return linecache.getline(f.f_code.co_filename, f.f_lineno, f.f_globals).strip()


def _locals(f: types.FrameType) -> tuple[Value, ...]:
    """The frame's variables worth showing: in a cell's top level (whose locals are the whole
    namespace) only the names the cell's code uses; never modules, functions or classes."""
    names = f.f_locals
    if f.f_code.co_name == "<module>":
        wanted = set(f.f_code.co_names) | set(f.f_code.co_varnames)
        names = {k: v for k, v in names.items() if k in wanted}
    shown = [(k, v) for k, v in names.items() if not k.startswith("__")
             and not isinstance(v, (types.ModuleType, types.FunctionType, type,
                                    types.BuiltinFunctionType, types.MethodType))]
    return tuple(Value(k, summarise(v)) for k, v in shown[:_MAX_VALUES])


def _tensor_values(f: types.FrameType) -> tuple[Value, ...]:
    """The tensors handed to the torch call: its arguments only (its own locals, such as
    relevant_args in torch's wrappers, are torch's business, not the learner's)."""
    import torch

    def is_tensors(v) -> bool:
        return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and bool(v)
                                               and isinstance(v[0], torch.Tensor))

    code, values = f.f_code, f.f_locals
    args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return tuple(Value(k, summarise(values[k])) for k in args
                 if k in values and is_tensors(values[k]))


def summarise(value) -> str:
    """A value in one short line: a tensor as dtype, shape, device and its first values (a GPU
    tensor's values are not read: copying them would wait for the work queued on it)."""
    import torch

    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        head = f"{dtype}[{', '.join(map(str, value.shape))}] {value.device}"
        if value.device.type != "cpu" or value.is_sparse or value.is_meta:
            return head + " (values not read)"
        try:
            flat = value.detach().reshape(-1)
            first = ", ".join(_number(x) for x in flat[:4].tolist())
        except (RuntimeError, TypeError):
            return head
        return f"{head} [{first}{', ...' if flat.numel() > 4 else ''}]"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return f"{type(value).__name__} of {len(value)} tensors, the first {summarise(value[0])}"
    if isinstance(value, torch.nn.Module):
        n = sum(p.numel() for p in value.parameters())
        return f"{type(value).__name__} ({n:,} parameters)"
    try:
        return _REPR.repr(value)
    except Exception as e:  # noqa: BLE001 - a broken __repr__ must not cost the snapshot
        return f"<{type(value).__name__}: repr failed: {type(e).__name__}>"


def _number(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)
