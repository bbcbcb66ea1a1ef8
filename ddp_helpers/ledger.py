"""The ledger: every collective and point-to-point call a rank makes, recorded where torch
dispatches the c10d and functional-collective ops.

One mechanism for everything in the kit that asks "which collectives did this code call?":
the exercise checks (an import alias such as `from torch.distributed import all_reduce` cannot
bypass it, nor can DDP's C++ reducer, DTensor or `torch.distributed.pipelining`, which all end at
these ops), the lessons' counts and bytes, and the engine's naming of mismatched collectives.

    with Ledger() as ledger:
        dist.all_reduce(t)
    ledger.calls[0]  # Call(seq=1, op='all_reduce', group='world', shapes=((4,),), ...)

A `Call` is recorded before the op runs, so a rank blocked inside a collective has it as its
last entry: `on_call` (a callable given to Ledger) is told of each call at that moment.
One limit, as for torch's CommDebugMode (a dispatch mode is per thread): a collective issued
from a future's `.then(...)` callback runs where the callback runs, which is the caller's thread
if the future was already done when the callback was attached and the backend's completion
thread if not. The mode sees it only in the first case, so its count can change from run to run;
a tapped ledger (below) sees it in both. PowerSGD's comm hook issues its second and third
all-reduce that way (lesson 10 counts them with a tapped ledger and at `dist.all_reduce`).
DDP's own bucket all-reduces are issued on the thread that runs backward and are seen.
Bytes are the tensors this rank hands in (for all_gather and reduce_scatter, its own input),
not what the backend's algorithm moves on the wire.

`Ledger(tap=True)` records the same calls without a dispatch mode: a kernel on the Autograd
key of each c10d op (installed once per process) tells every tapped ledger. A dispatch mode
runs Python for every op (a small MLP's training step was 2.3x slower under an empty mode on
two CPU cores); the tap runs Python only for collectives, which is why the engine keeps one on
for every cell and launched function. It sees the c10d ops (DDP's reducer, DTensor on gloo
and NCCL end there too), not `_c10d_functional` ops traced by torch.compile, and not tensors
made under torch.inference_mode (they have no Autograd key).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d's op names (and the functional collectives') -> the name a learner calls.
OP_NAMES = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "all_gather_into_tensor": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "send": "send",
    "recv_": "recv", "recv_any_source_": "recv", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "barrier": "barrier", "monitored_barrier_": "monitored_barrier"}
# c10d ops whose first argument is the output buffer: the input this rank gives is the second.
_INPUT_SECOND = {"allgather_", "_allgather_base_", "reduce_scatter_", "_reduce_scatter_base_",
                 "allgather_into_tensor_coalesced_", "allgather_coalesced_", "alltoall_",
                 "alltoall_base_", "scatter_", "reduce_scatter_tensor_coalesced_", "gather_"}
POINT_TO_POINT = {"send", "recv"}
_NAMESPACES = ("c10d", "_c10d_functional")
# Frames inside these folders are torch's or the kit's plumbing, never the caller to name.
_SKIP = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (
    os.path.abspath(__file__), os.path.dirname(os.path.abspath(__file__)) + os.sep + "engine")


@dataclass(frozen=True)
class Call:
    """One collective or send/recv: its number in its group on this rank (1, 2, ...), the op
    as a learner names it, the group ('world' or 'ranks [0, 2]'), the shapes and dtypes of the
    tensors this rank handed in, their bytes, and the caller's (file, line)."""

    seq: int
    op: str
    group: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int
    where: tuple[str, int] = ("?", 0)
    peer: int | None = None  # send/recv: the other rank, where torch passes it
    root: int | None = None  # broadcast/reduce/gather/scatter: src or dst, as a group rank

    def tensors(self) -> str:
        """'float32[4]', or 'float32[4], float32[2, 3]' for a list; '' for a barrier."""
        return ", ".join(f"{d}[{', '.join(map(str, s))}]" for s, d in zip(self.shapes,
                                                                         self.dtypes))

    def text(self) -> str:
        """e.g. 'all_reduce #3 float32[4]' (and ' in ranks [0, 1]' for a subgroup)."""
        peer = "" if self.peer is None else (" to" if self.op == "send" else " from") + \
            f" rank {self.peer}"
        group = "" if self.group == "world" else f" in {self.group}"
        return f"{self.op} #{self.seq} {self.tensors()}".rstrip() + peer + group


class Ledger(TorchDispatchMode):
    """Record every collective this rank calls while the mode is on (a TorchDispatchMode, as
    torch's CommDebugMode is): `calls` in order, `summary()` per op, `text()` for one line.
    `on_call(call)`, if given, is told of each call before the op runs. `keep_inputs=True`
    also keeps a CPU copy of each call's input tensors as they were before the op, in `inputs`
    (one list per call): what an exercise check reads to see what a rank contributed."""

    def __init__(self, on_call: Callable[[Call], None] | None = None, *, tap: bool = False,
                 keep_inputs: bool = False):
        super().__init__()
        self.on_call = on_call
        self.calls: list[Call] = []
        self.inputs: list[list[torch.Tensor]] | None = [] if keep_inputs else None
        self._seq: dict[str, int] = {}
        self._tap = tap

    def __enter__(self):
        if not self._tap:
            return super().__enter__()
        _install_tap()
        _TAPPED.append(self)
        return self

    def __exit__(self, *exc):
        if not self._tap:
            return super().__exit__(*exc)
        _TAPPED.remove(self)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)  # no schema, and never a collective
        if _is_dtensor(types):
            return NotImplemented  # let DTensor turn itself into plain collectives first
        namespace, _, name = func._schema.name.partition("::")
        if namespace in _NAMESPACES and name in OP_NAMES:
            self._record(namespace, name, args)
        return func(*args, **kwargs)

    def _record(self, namespace: str, name: str, args: tuple) -> None:
        given = args[1] if namespace == "c10d" and name in _INPUT_SECOND else args[0]
        if name == "barrier":
            given = []  # a barrier hands gloo a dummy tensor: not the learner's
        tensors = _tensors(given)
        group = _group_of(args)
        self._seq[group] = self._seq.get(group, 0) + 1
        call = Call(self._seq[group], OP_NAMES[name], group,
                    tuple(tuple(t.shape) for t in tensors),
                    tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                    sum(t.numel() * t.element_size() for t in tensors), caller(),
                    _peer(name, args), _root(namespace, name, args))
        self.calls.append(call)
        if self.inputs is not None:
            self.inputs.append([t.detach().cpu().clone() for t in tensors])
        if self.on_call is not None:
            self.on_call(call)

    def summary(self) -> dict[str, tuple[int, int]]:
        """{op: (calls, bytes)}, ops in alphabetical order."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.calls:
            n, size = out.get(c.op, (0, 0))
            out[c.op] = (n + 1, size + c.nbytes)
        return dict(sorted(out.items()))

    def counts(self) -> dict[str, int]:
        """{op: calls}, ops in alphabetical order."""
        return {op: n for op, (n, _) in self.summary().items()}

    def text(self) -> str:
        """e.g. "all_reduce x1 (512 B)"; "none" if nothing was called."""
        return ", ".join(f"{op} x{c} ({b:,} B)" for op, (c, b) in self.summary().items()) or "none"


_TAPPED: list[Ledger] = []  # the tapped ledgers now on, innermost last
_TAP_LIBRARY = None  # the torch.library registration of the tap kernels, once per process


def _install_tap() -> None:
    """Put a recording kernel on the Autograd key of every c10d op that has none."""
    global _TAP_LIBRARY
    if _TAP_LIBRARY is not None:
        return
    library = torch.library.Library("c10d", "IMPL")  # noqa: TOR901 - kept for the process
    for name in OP_NAMES:
        try:
            op = getattr(torch.ops.c10d, name).default
        except (AttributeError, RuntimeError):
            continue  # an op this torch does not have
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd"):
            continue
        library.impl(name, _tap_kernel(name, op), "Autograd")
    _TAP_LIBRARY = library


def _tap_kernel(name: str, op):
    def kernel(*args, **kwargs):
        for ledger in list(_TAPPED):
            ledger._record("c10d", name, args)
        with torch._C._AutoDispatchBelowAutograd():  # on to the backend's kernel
            return op(*args, **kwargs)

    return kernel


def record(work: Callable[[], object]) -> Ledger:
    """Run work() with a fresh Ledger on; return the ledger."""
    with Ledger() as ledger:
        work()
    return ledger


def caller() -> tuple[str, int]:
    """(file, line) of the innermost frame outside torch and the kit's engine: the learner's
    cell or script line that led to this collective."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP) and not path.startswith("<frozen"):
            return path, frame.f_lineno
        frame = frame.f_back
    return "?", 0


def _is_dtensor(types) -> bool:
    from torch.distributed.tensor import DTensor  # imported late: it is slow to import

    return any(issubclass(t, DTensor) for t in types)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_of(args: tuple) -> str:
    """'world' for the default group, 'ranks [0, 2]' for another; functional collectives pass
    the group by name."""
    for a in args:
        if isinstance(a, str) and not a.isdigit():
            pg = _pg_by_name(a)
        elif isinstance(a, torch.ScriptObject):  # how the dispatcher hands over a group
            pg = _unbox(a)
            if pg is None:
                continue  # a ReduceOp, not a group
        else:
            continue
        if pg is None:
            return f"group {a}"
        if dist.is_initialized() and pg == dist.group.WORLD:
            return "world"
        try:
            return f"ranks {dist.get_process_group_ranks(pg)}"
        except (RuntimeError, ValueError):  # not registered with c10d: name what we have
            return f"group {getattr(pg, 'group_name', '?')}"
    return "world"


def _unbox(obj):
    try:
        return dist.ProcessGroup.unbox(obj)
    except (RuntimeError, TypeError, AttributeError):
        return None


def _pg_by_name(name: str):
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name)
    except (ImportError, RuntimeError, ValueError, KeyError):
        return None


_ROOT_AT: dict[str, int | None] = {}  # c10d op -> the position of its root_rank argument


def _root(namespace: str, name: str, args: tuple) -> int | None:
    """The root (src or dst) a rooted c10d op was given, as a rank of its group; found by the
    schema's argument name, whose position differs between ops."""
    if namespace != "c10d":
        return None
    if name not in _ROOT_AT:
        try:
            names = [a.name for a in getattr(torch.ops.c10d, name).default._schema.arguments]
        except (AttributeError, RuntimeError):
            names = []
        _ROOT_AT[name] = names.index("root_rank") if "root_rank" in names else None
    at = _ROOT_AT[name]
    return args[at] if at is not None and at < len(args) and isinstance(args[at], int) else None


def _peer(name: str, args: tuple) -> int | None:
    """send(tensors, group, dst, tag) / recv_(tensors, group, src, tag): the peer as a group
    rank, where the op carries it."""
    if name in ("send", "recv_") and len(args) > 2 and isinstance(args[2], int):
        return args[2]
    return None
