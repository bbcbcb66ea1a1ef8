"""Every message between the parent and its ranks, in one place, with the protocol's version.

A message is a small frozen dataclass, pickled whole by wire.channel. Commands go to a rank,
replies and reports come back; the rank side and the parent side both build and read them
here, so that no field is matched by position anywhere else.
"""

from __future__ import annotations

import enum
import traceback as _traceback
from dataclasses import dataclass, field
from typing import Any

# Raised whenever a message changes shape. A forked rank gets it in its spec and a served rank
# in its Hello; each side refuses the other's if it differs (a kernel that upgraded the kit
# while its start server still holds the old code, or a torchrun job of another version).
VERSION = 3

# -- how a rank starts: the payload every forked rank is given -----------------------------


@dataclass(frozen=True)
class RunFunction:
    """A one-shot run (dh.launch): call fn(rank, *args) and reply once."""

    fn: Any
    args: tuple


@dataclass(frozen=True)
class ServeCells:
    """A persistent rank (dh.Ranks): set up, reply Ready, then serve commands until Stop."""

    world_size: int
    group: bool  # False: no process group (the lesson makes its own)
    timeout: float  # the group's timeout for one collective, in seconds


Start = RunFunction | ServeCells

# -- commands: parent -> persistent rank -----------------------------------------------------


@dataclass(frozen=True)
class RunCell:
    """Run `code` as cell `number` (compiled as "<cell N>"); reply with its last value and the
    variables in `returns`. `first_line` is the number its first line gets in tracebacks and
    the ledger (2 below a %%ranks line)."""

    number: int
    code: str
    returns: tuple[str, ...] = ()
    first_line: int = 1


@dataclass(frozen=True)
class Push:
    """Set these variables in the rank's namespace."""

    values: dict[str, Any]


@dataclass(frozen=True)
class Stop:
    """Leave the command loop (destroying the process group) and exit."""


@dataclass(frozen=True)
class Debug:
    """Open pdb post-mortem on the frame where this rank's last failing cell raised; the rank
    sends DebugOutput for every prompt and reads DebugLine commands until pdb ends, then
    replies Ok (its namespace untouched)."""


@dataclass(frozen=True)
class DebugLine:
    """One line the learner typed at the rank's pdb prompt."""

    text: str


@dataclass(frozen=True)
class Summarise:
    """Reply Ok({expression: Summary}) for each expression, evaluated in the namespace: what
    `pool.compare` compares across ranks."""

    expressions: tuple[str, ...]
    chunk: tuple[str, int] | None = None  # (expression's leaf, chunk): send that chunk's values


Command = RunCell | Push | Stop | Debug | DebugLine | Summarise

# -- questions: parent -> a rank's control thread, answered while its main thread is busy ---


@dataclass(frozen=True)
class AskWhere:
    """Where is your main thread now?"""


@dataclass(frozen=True)
class AskStack:
    """Your main thread's stack, with each frame's locals summarised (for a snapshot before the
    kit stops the ranks, and for `%ranks where`)."""


Question = AskWhere | AskStack

# -- replies and answers: rank -> parent -----------------------------------------------------


@dataclass(frozen=True)
class Ok:
    """Success: a launched function's return value, or a cell's last value (None for a
    statement) with the variables it was asked to return."""

    value: Any = None
    returned: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ready:
    """A persistent rank has set up and waits for cells."""

    pid: int
    device: str
    backend: str | None  # None: no process group (the lesson makes its own)


@dataclass(frozen=True)
class Error:
    """A rank raised: the exception's type name, its message, and the traceback text (cells
    named "<cell N>" as they ran; the parent names them as the learner knows them)."""

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, e: BaseException, traceback: str | None = None) -> Error:
        """The reply for `e`; `traceback` defaults to the one being handled."""
        tb = _traceback.format_exc() if traceback is None else traceback
        return cls(type(e).__qualname__, str(e), tb)

    @classmethod
    def unreadable_result(cls, e: BaseException) -> Error:
        """The parent could not rebuild what a rank sent (e.g. an object of a %%ranks class)."""
        return cls("UnpicklingError",
                   f"the rank's result could not be rebuilt in this process: "
                   f"{type(e).__name__}: {e}. Return plain data (numbers, strings, lists, dicts, "
                   "tensors) instead of objects of classes defined on the ranks.")

    @classmethod
    def version_mismatch(cls, theirs: int) -> Error:
        """The two sides run different versions of the kit."""
        return cls("RuntimeError",
                   f"the parent speaks ddp_helpers protocol {theirs} and this rank {VERSION}: "
                   "the two sides run different versions of the kit (it was upgraded or edited "
                   "while this kernel's start server, or the torchrun job, still ran the old "
                   "one). Restart the kernel, and the torchrun job if there is one.")


Reply = Ok | Ready | Error


@dataclass(frozen=True)
class Frame:
    """One frame of a rank's stack, as the rank saw it: the file as Python names it ("<cell
    12>" for a cell: the parent renders the learner's name), line, function, source line."""

    file: str
    line: int
    function: str
    text: str = ""


@dataclass(frozen=True)
class Where:
    """Where a rank's main thread was when asked: idle (between cells), or at `frame` (the
    innermost frame of the learner's code) inside the torch call `call`; `in_comm` when it
    waits in communication."""

    idle: bool = False
    in_comm: bool = False
    frame: Frame | None = None
    call: str | None = None


@dataclass(frozen=True)
class Value:
    """A value as a rank summarised it: a tensor as dtype, shape, device and its first values
    ("float32[4] cpu [1.0, 2.0, nan, 4.0]"), anything else as a short repr."""

    name: str
    text: str


@dataclass(frozen=True)
class FrameLocals:
    """A frame of a stack snapshot: where (as Frame) and its locals, summarised."""

    frame: Frame
    values: tuple[Value, ...] = ()


@dataclass(frozen=True)
class Stack:
    """A rank's main thread as its control thread saw it: idle between cells, or in the
    learner's frames (outermost first), in the torch call `call`, `in_comm` when it waits on
    its peers. `failure`: the last failing cell's exception, kept for post-mortem ("" none)."""

    idle: bool
    frames: tuple[FrameLocals, ...] = ()
    call: str | None = None
    call_values: tuple[Value, ...] = ()  # the tensors the torch call was handed
    in_comm: bool = False
    failure: str = ""


@dataclass(frozen=True)
class DebugOutput:
    """What the rank's pdb printed since the last prompt; `prompt` is the prompt it now waits
    at (None: the session ended, or there was nothing to debug)."""

    text: str
    prompt: str | None = "(Pdb) "


@dataclass(frozen=True)
class Summary:
    """One leaf of a summarised value (a tensor, or a plain value) on one rank: `digest` is
    the same on two ranks exactly when their values are; `values` the tensor itself when small
    (the parent finds the first difference), else None (it asks for one chunk)."""

    name: str
    kind: str  # "tensor" | "value" | "missing"
    dtype: str = ""
    shape: tuple[int, ...] = ()
    digest: str = ""
    values: Any = None
    chunk_digests: tuple[str, ...] = ()  # large tensors: a digest per chunk of CHUNK elements
    text: str = ""  # a plain value's repr, or why it is missing


CHUNK = 1 << 16  # elements per chunk of a large tensor's digests


def answers(question) -> type:
    """The type of the answer to `question`."""
    return Stack if isinstance(question, AskStack) else Where


class Stream(enum.Enum):
    """What a stream of bytes from a rank carries."""

    OUT = "stdout"
    ERR = "stderr"
    LEDGER = "ledger"  # one line per collective entered (wire.ledger_line)


@dataclass(frozen=True)
class Output:
    """Bytes a served rank wrote to a stream (forked ranks write them to pipes instead)."""

    stream: Stream
    data: bytes


# -- the handshake of a served rank (after auth's challenge) ---------------------------------


@dataclass(frozen=True)
class Hello:
    """Who a served rank is: what torchrun (or Slurm) told it, and where it runs."""

    rank: int
    world_size: int
    local_rank: int
    group_rank: int  # the node's index among torchrun's agents (GROUP_RANK)
    host: str
    pid: int
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT: how often this node's agent restarted it
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS: torchrun's --max-restarts (0: none)
    version: int = VERSION


@dataclass(frozen=True)
class Setup:
    """The notebook's answer to a Hello: join, with this environment (backend) and options."""

    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 60.0
    group: bool = True
    generation: str = ""  # the same for every rank of one attached group, new for the next


@dataclass(frozen=True)
class Refused:
    """The notebook's answer to a Hello it cannot take (a duplicate rank, a wrong world size,
    another protocol version)."""

    reason: str


def restarts_left(hellos) -> int:
    """How many more times torchrun is sure to restart this group: the fewest any node's agent
    has left (an agent with none left ends the job when its workers fail; an agent counts a
    restart only when its own workers failed, so the nodes' counts may differ)."""
    return min((h.max_restarts - h.restart for h in hellos), default=0)
