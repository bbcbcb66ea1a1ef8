"""Where a rank's main thread is, asked from another thread of the rank (its control thread):
the main thread may be blocked in a collective, which releases the GIL, and the parent wants
to say where. What the parent asks arrives as a wire question; `answer` answers it."""

from __future__ import annotations

import os
import sys
import traceback

from ..wire.messages import AskWhere, Frame, Where

CELL_PREFIX = "<cell "  # cells run as "<cell N>" (rank.cells)
# Where a stuck main thread waits on its peers: frames in these parts of torch. Backward counts
# because DDP's reducer waits for its bucket all-reduces at the end of backward.
_COMM_PATHS = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")


def answer(question, main_thread: int):
    """The answer to a parent's question about the thread `main_thread`."""
    if isinstance(question, AskWhere):
        return where(main_thread)
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
