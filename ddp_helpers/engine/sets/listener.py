"""The notebook's door for ranks that torchrun or Slurm started: a listening socket, a token
file, and a thread that lets in exactly the ranks the pool waits for.

Every connection is challenged (auth.py) before anything it sends is read as a message; one
that fails is closed, and nothing it sent was unpickled or run. Once every rank is in and the
pool takes them, the socket closes: nobody else (a second notebook, a stray worker) can attach
to these ranks, and the ranks themselves listen on nothing.

Unless torchrun may restart them (`--max-restarts`, in each rank's Hello): then the socket
stays open for the next generation only, a complete group of the same world size whose
workers are new processes (a connection from a worker of the taken group is refused) with
restart counts no lower than the taken group's. The pool takes that group once it finds the
old one dead; until then it waits here, so no worker of it times out while the notebook idles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import threading

from ..wire import auth
from ..wire.channel import Channel, over_socket
from ..wire.messages import VERSION, Hello, Refused, Setup, restarts_left

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
        self.attached: dict[int, Attached] = {}  # the generation being gathered
        self.previous: list[Hello] = []  # the generation the pool took last
        self.generation = secrets.token_hex(8)  # names the group being gathered (in Setup)
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
        chan = over_socket(conn)  # authenticated: from here on its messages may be unpickled
        try:
            hello = chan.recv_small(auth.HANDSHAKE_SECONDS)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, it is not let in
            self._refuse(chan, f"{peer[0]}: no Hello ({type(e).__name__}: {e})")
            return
        with self.changed:
            reason = self._why_not(hello)
            if reason is None:
                self.attached[hello.rank] = Attached(hello, chan)
                setup = dataclasses.replace(self.setup, generation=self.generation)
            self.changed.notify_all()
        if reason is not None:
            with contextlib.suppress(OSError, ValueError):
                chan.send(Refused(reason))
            self._refuse(chan, f"{peer[0]}: {reason}")
            return
        try:
            chan.send(setup)
        except (OSError, ValueError):
            pass  # its death shows up as EOF on the channel
        with self.changed:
            if self.full() and restarts_left([a.hello for a in self.attached.values()]) <= 0:
                self.close()  # every rank is in and none will restart: nobody else may attach

    def _why_not(self, hello) -> str | None:
        if not isinstance(hello, Hello):
            return f"expected a Hello, got {type(hello).__name__}"
        if hello.version != VERSION:
            return (f"it speaks ddp_helpers protocol {hello.version} and the notebook "
                    f"{VERSION}: run the same version of the kit on both sides")
        if self._closed or self.full():
            return "every rank is already attached"
        if hello.world_size != self.nprocs:
            return (f"WORLD_SIZE is {hello.world_size}, but the notebook listens for "
                    f"{self.nprocs} ranks")
        if not 0 <= hello.rank < self.nprocs or hello.rank in self.attached:
            return f"rank {hello.rank} is already attached (or out of range)"
        return self._stale(hello)

    def _stale(self, hello: Hello) -> str | None:
        """Why `hello` cannot be of the group torchrun restarts after the taken one (None: it
        can be)."""
        if any((old.host, old.pid) == (hello.host, hello.pid) for old in self.previous):
            return (f"rank {hello.rank} (pid {hello.pid} on {hello.host}) is a worker of the "
                    "old generation: only the fresh group torchrun restarts may attach")
        counts = [old.restart for old in self.previous if old.group_rank == hello.group_rank]
        if counts and hello.restart < max(counts):
            return (f"rank {hello.rank} has TORCHELASTIC_RESTART_COUNT {hello.restart}, older than "
                    f"the attached group's {max(counts)}: a worker of an old generation")
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

    def take(self) -> dict[int, Attached]:
        """Hand over the complete group; listen on for the one torchrun would restart (only
        while every node's agent has a restart left), or else close."""
        with self.changed:
            group, self.attached = self.attached, {}
            self.previous = [a.hello for a in group.values()]
            self.generation = secrets.token_hex(8)
            if restarts_left(self.previous) <= 0:
                self.close()
        return group

    @property
    def listening(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Stop listening (the accept thread ends)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def shutdown(self) -> None:
        """Stop listening, drop the ranks gathered but not taken (they exit), and delete the
        token file it made (a restarted worker that finds it gone gives up at once)."""
        self.close()
        with self.changed:
            gathered, self.attached = self.attached, {}
        for a in gathered.values():
            with contextlib.suppress(OSError):
                a.chan.close()
        self.remove_token()

    def remove_token(self) -> None:
        """Delete the token file if the listener made it."""
        if self.own_token_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.token_file)
