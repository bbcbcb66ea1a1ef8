"""What the parent and its ranks say to each other: named commands and replies, built and read
here, and the transport under them.

Both sides import this module (ranks import it from the start server's preload, so it stays free
of torch and of the learner's code). A message is a small frozen dataclass; `Channel` frames it
as one pickle per message over any transport with `send_bytes` / `recv_bytes` / `poll` /
`fileno` / `close`: a multiprocessing pipe for ranks the kit forked, or the same Connection over
a socket for ranks that torchrun or Slurm started.

The pickling safety rule lives here too: a message the receiving side cannot rebuild (a class
defined only on the other side) is `Unreadable`, which each side turns into an `Error` reply, so
it never costs a rank.
"""

from __future__ import annotations

import pickle
import traceback as _traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

# -- commands: parent -> persistent rank -----------------------------------------------------


@dataclass(frozen=True)
class RunCell:
    """Run `code` as cell `number`; reply with its last value and the variables in `returns`.
    `first_line` is the number its first line gets in tracebacks and the ledger, `label` the
    name the learner knows the cell by."""

    number: int
    code: str
    returns: tuple[str, ...] = ()
    first_line: int = 1
    label: str | None = None  # the cell's name in tracebacks: "In [5]" (else "cell <number>")


@dataclass(frozen=True)
class Push:
    """Set these variables in the rank's namespace."""

    values: dict[str, Any]


@dataclass(frozen=True)
class Stop:
    """Leave the command loop (destroying the process group) and exit."""


@dataclass(frozen=True)
class AskWhere:
    """Asked on the control channel: where is your main thread now?"""


Command = RunCell | Push | Stop

# -- replies: rank -> parent -----------------------------------------------------------------


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
    """A rank raised: the exception's type name, its message, and the traceback text."""

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


@dataclass(frozen=True)
class Where:
    """Where a rank's main thread was when asked: idle (between cells), or at a cell's line
    and inside which torch call; `in_comm` when it waits in communication."""

    idle: bool = False
    in_comm: bool = False
    cell: str | None = None
    call: str | None = None
    exited: bool = False  # set by the parent for a rank whose process had gone


Reply = Ok | Ready | Error

# -- transport -------------------------------------------------------------------------------


class Transport(Protocol):
    """What a channel needs to carry whole messages: multiprocessing's Connection, over a pipe
    or a socket, is one."""

    def send_bytes(self, data: bytes) -> None: ...

    def recv_bytes(self) -> bytes: ...

    def poll(self, timeout: float = 0.0) -> bool: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class Unreadable(Exception):
    """A message arrived whole but could not be rebuilt here; `cause` says why."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class Channel:
    """Messages over a transport: one pickle per message, each side reading whole messages.

    send() raises OSError/ValueError once the other side is gone; recv() raises EOFError or
    OSError then, and Unreadable for a message this process cannot rebuild.
    """

    def __init__(self, transport: Transport):
        self.transport = transport

    def send(self, message) -> None:
        self.transport.send_bytes(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Send what encode() made (a rank encodes first, so that a value it cannot pickle
        becomes an Error reply instead of a failed send)."""
        self.transport.send_bytes(data)

    def recv(self):
        data = self.transport.recv_bytes()
        try:
            return pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - any failure to rebuild is reported the same way
            raise Unreadable(e) from e

    def poll(self, timeout: float = 0.0) -> bool:
        return self.transport.poll(timeout)

    def fileno(self) -> int:  # lets multiprocessing.connection.wait watch a channel
        return self.transport.fileno()

    def close(self) -> None:
        self.transport.close()


def encode(message) -> bytes:
    """A message as the bytes a channel sends; raises what pickle raises for a value that
    cannot be pickled."""
    return pickle.dumps(message)
