"""The notebook's door for ranks that torchrun or Slurm started: a listening socket, a token
file, and a thread that lets in exactly the ranks the pool waits for.

Every connection is challenged (auth.py) before anything it sends is read as a message; one
that fails is closed, and nothing it sent was unpickled or run. Once every rank is in, the
socket closes: nobody else (a second notebook, a stray worker) can attach to these ranks, and
the ranks themselves listen on nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

from . import auth
from .protocol import Channel
from .sockets import Hello, Refused, Setup, channel, recv_small

_BACKLOG = 64


class Attached:
    """A rank that proved the token and said who it is."""

    def __init__(self, hello: Hello, chan: Channel):
        self.hello, self.chan = hello, chan


class Listener:
    """Listens on host:port (loopback by default) for `nprocs` served ranks.

    `attached` fills in (rank -> Attached) from the accept thread; `refusals` counts the
    connections turned away, `notes` says why (for the notebook's messages and the tests).
    """

    def __init__(self, nprocs: int, host: str, port: int, setup: Setup,
                 token_file: str | None = None):
        self.nprocs, self.setup = nprocs, setup
        # A given path may already hold a token (kept across sessions) or gets a fresh one.
        self.own_token_file = token_file is None
        self.token_file = auth.new_token_file() if token_file is None else \
            auth.token_file_at(token_file)
        self.token = auth.read_token(self.token_file)
        self.sock = socket.create_server((host, port), backlog=_BACKLOG, reuse_port=False)
        self.host, self.port = self.sock.getsockname()[:2]
        self.attached: dict[int, Attached] = {}
        self.refusals = 0
        self.notes: list[str] = []
        self.changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="ddp_helpers-listen",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return self.host.startswith("127.") or self.host in ("::1", "localhost")

    def full(self) -> bool:
        return len(self.attached) >= self.nprocs

    # -- the accept thread --------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            # One thread per connection: a peer that stalls its handshake holds up no other.
            threading.Thread(target=self._admit, args=(conn, peer), daemon=True).start()

    def _admit(self, conn: socket.socket, peer) -> None:
        try:
            auth.serve_challenge(conn, self.token)
        except (auth.AuthError, OSError) as e:
            self._refuse(conn, f"{peer[0]}: {e}")
            return
        chan = channel(conn)  # authenticated: from here on its messages may be unpickled
        try:
            hello = recv_small(chan, auth.HANDSHAKE_SECONDS)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, it is not let in
            self._refuse(chan, f"{peer[0]}: no Hello ({type(e).__name__}: {e})")
            return
        with self.changed:
            reason = self._why_not(hello)
            if reason is None:
                self.attached[hello.rank] = Attached(hello, chan)
            self.changed.notify_all()
        if reason is not None:
            with contextlib.suppress(OSError, ValueError):
                chan.send(Refused(reason))
            self._refuse(chan, f"{peer[0]}: {reason}")
            return
        try:
            chan.send(self.setup)
        except (OSError, ValueError):
            pass  # its death shows up as EOF on the channel
        if self.full():
            self.close()  # every rank is in: nobody else may attach

    def _why_not(self, hello) -> str | None:
        if not isinstance(hello, Hello):
            return f"expected a Hello, got {type(hello).__name__}"
        if self._closed or self.full():
            return "every rank is already attached"
        if hello.world_size != self.nprocs:
            return (f"WORLD_SIZE is {hello.world_size}, but the notebook listens for "
                    f"{self.nprocs} ranks")
        if not 0 <= hello.rank < self.nprocs or hello.rank in self.attached:
            return f"rank {hello.rank} is already attached (or out of range)"
        return None

    def _refuse(self, conn, note: str) -> None:
        with self.changed:  # counted before the peer can see the close
            self.refusals += 1
            self.notes.append(note)
            self.changed.notify_all()
        with contextlib.suppress(OSError):
            conn.close()

    # -- the notebook's side --------------------------------------------------------------------

    def wait(self, until_count: int, seconds: float) -> bool:
        """Block until `until_count` ranks are attached or `seconds` pass; True if they are."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.attached) >= until_count, seconds)

    def close(self) -> None:
        """Stop listening (the accept thread ends)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def shutdown(self) -> None:
        """Stop listening and delete the token file it made."""
        self.close()
        self.remove_token()

    def remove_token(self) -> None:
        """Delete the token file if the listener made it."""
        if self.own_token_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.token_file)
