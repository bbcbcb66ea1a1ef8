"""The socket transport: ranks that torchrun or Slurm started (`python -m ddp_helpers.serve`)
carry the same protocol messages as forked ranks, over one TCP connection per rank instead of
pipes. Both sides import this module, so it stays free of torch.

One connection carries everything the pipes carry separately: the parent's commands and
"where are you?" questions one way; replies, answers and the rank's output (as `Output`
messages) the other. It is opened by the rank, challenged by the notebook (auth.py) before any
message is read, and then speaks pickles (protocol.Channel) with the peer that proved it holds
the token; bytes from anyone else are never unpickled.

After the handshake the rank says who it is (`Hello`) and the notebook answers with what the
rank should do (`Setup`) or why it may not join (`Refused`).
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import socket
from dataclasses import dataclass, field

from .protocol import Channel

_HELLO_BYTES = 64 * 1024  # a Hello (or Setup) is a few hundred bytes: bound what is read


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


def restarts_left(hellos) -> int:
    """How many more times torchrun is sure to restart this group: the fewest any node's agent
    has left (an agent with none left ends the job when its workers fail; an agent counts a
    restart only when its own workers failed, so the nodes' counts may differ)."""
    return min((h.max_restarts - h.restart for h in hellos), default=0)


@dataclass(frozen=True)
class Setup:
    """The notebook's answer to a Hello: join, with this environment (backend) and options."""

    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 60.0
    group: bool = True
    generation: str = ""  # the same for every rank of one attached group, new for the next


@dataclass(frozen=True)
class Refused:
    """The notebook's answer to a Hello it cannot take (a duplicate rank, a wrong world size)."""

    reason: str


@dataclass(frozen=True)
class Output:
    """Bytes a served rank wrote to its stdout ("out") or stderr ("err"), or its ledger feed's
    lines ("led": one per collective entered, ledger_feed.py)."""

    kind: str
    data: bytes


def channel(sock: socket.socket) -> Channel:
    """A protocol Channel over a connected (and authenticated) socket; takes over the socket."""
    sock.settimeout(None)
    return Channel(multiprocessing.connection.Connection(sock.detach()))


def recv_small(chan: Channel, seconds: float):
    """One message of at most _HELLO_BYTES within `seconds` (the exchange right after the
    handshake); raises EOFError or OSError if it does not come whole in time."""
    if not chan.poll(seconds):
        raise TimeoutError(f"no message within {seconds:g} s")
    data = chan.transport.recv_bytes(_HELLO_BYTES)
    return pickle.loads(data)


def parse_address(text: str) -> tuple[str, int]:
    """"host:port" (or "[v6]:port") as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{text!r}: give HOST:PORT, e.g. 127.0.0.1:29600")
    return host.strip("[]"), int(port)
