"""Messages over a transport: one pickle per message, each side reading whole messages.

The transport is multiprocessing's Connection, over the pipes the kit opens for the ranks it
forks or over the TCP connection a served rank opens (after wire.auth's handshake: bytes from
a peer that did not prove the token are never unpickled). A message the receiving side cannot
rebuild (a class defined only on the other side) is `Unreadable`, which each side turns into
an Error reply, so it never costs a rank.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import socket
from typing import Protocol

_SMALL_BYTES = 64 * 1024  # a Hello (or Setup) is a few hundred bytes: bound what is read


class Transport(Protocol):
    """What a channel needs to carry whole messages: multiprocessing's Connection, over a pipe
    or a socket, is one."""

    def send_bytes(self, data: bytes) -> None: ...

    def recv_bytes(self, maxlength: int | None = None) -> bytes: ...

    def poll(self, timeout: float = 0.0) -> bool: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class Unreadable(Exception):
    """A message arrived whole but could not be rebuilt here; `cause` says why."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class Channel:
    """Messages over a transport. send() raises OSError/ValueError once the other side is gone;
    recv() raises EOFError or OSError then, and Unreadable for a message this process cannot
    rebuild."""

    def __init__(self, transport: Transport):
        self.transport = transport

    def send(self, message) -> None:
        self.transport.send_bytes(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Send what encode() made (a rank encodes first, so that a value it cannot pickle
        becomes an Error reply instead of a failed send)."""
        self.transport.send_bytes(data)

    def recv(self):
        return decode(self.transport.recv_bytes())

    def recv_small(self, seconds: float):
        """One message of at most 64 KiB within `seconds` (the exchange right after the
        handshake); raises TimeoutError, EOFError or OSError if it does not come whole."""
        if not self.poll(seconds):
            raise TimeoutError(f"no message within {seconds:g} s")
        return decode(self.transport.recv_bytes(_SMALL_BYTES))

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


def decode(data: bytes):
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - any failure to rebuild is reported the same way
        raise Unreadable(e) from e


def over_socket(sock: socket.socket) -> Channel:
    """A Channel over a connected (and authenticated) socket; takes over the socket."""
    sock.settimeout(None)
    return Channel(multiprocessing.connection.Connection(sock.detach()))


def parse_address(text: str) -> tuple[str, int]:
    """"host:port" (or "[v6]:port") as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{text!r}: give HOST:PORT, e.g. 127.0.0.1:29600")
    return host.strip("[]"), int(port)
