"""The rank's end of its link to the parent, one interface over two transports: `PipeLink` for
a rank the kit forked (a pipe each for commands, replies, control questions and the ledger)
and `SocketLink` for a rank torchrun started (everything over its one socket). The cell server
(rank.cells) reads commands and sends replies through either; a thread of the rank answers
the parent's questions at once, even while the main thread sits in a collective."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import threading
from collections.abc import Callable

from ..wire import ledger_line
from ..wire.channel import Channel, Unreadable, encode
from ..wire.messages import Output, Question, Stream
from .stacks import answer

_PIPE_BUF = 4096  # a pipe write up to this size is all or nothing, even non-blocking
_PIPE_SIZE = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size


class LedgerPipe:
    """A forked rank's ledger feed: one JSON line per collective into the parent's pipe. The
    pipe is non-blocking, so a rank never waits for the parent: a line that does not fit is
    dropped and counted, and the next line says how many were lost, so the parent stops
    comparing that rank instead of comparing a wrong count."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        # The parent reads this pipe once per poll (a quarter second at most): room for about
        # ten thousand lines in between, where Linux allows (its default is 64 KiB).
        with contextlib.suppress(AttributeError, OSError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        self.fd = fd
        self.dropped = 0

    def __call__(self, call) -> None:
        line = ledger_line.encode(call)
        if self.dropped:
            line = ledger_line.encode_dropped(self.dropped) + line
        try:
            os.write(self.fd, line[-_PIPE_BUF:])
            self.dropped = 0
        except OSError:  # full (the parent is behind) or gone: never block the rank
            self.dropped += 1


class PipeLink:
    """A forked rank's pipes (from its RankSpec, rank.entry)."""

    def __init__(self, spec):
        self.commands, self.replies = Channel(spec.commands), Channel(spec.result)
        self.control = Channel(spec.control)
        self.feed_ledger: Callable = LedgerPipe(spec.ledger.fileno())

    def start(self, main_thread: int, kept) -> None:
        """Answer the parent's questions from a thread of this rank (`kept`: what the cell
        server keeps, rank.cells.Kept)."""

        def serve_questions() -> None:
            while True:
                try:
                    question = self.control.recv()
                    self.control.send(answer(question, main_thread, kept.describe()))
                except Unreadable:
                    continue  # a message this rank cannot rebuild: the next question counts
                except (EOFError, OSError):
                    return

        threading.Thread(target=serve_questions, name="ddp_helpers-control", daemon=True).start()

    def recv(self):
        """The next command (raises EOFError once the parent is gone, Unreadable as sent)."""
        return self.commands.recv()

    def send(self, message) -> None:
        self.replies.send(message)

    def send_encoded(self, data: bytes) -> None:
        self.replies.send_encoded(data)


class SocketLink:
    """A served rank's one connection: one lock for every sender (the main thread's replies,
    answers, the output forwarder, the ledger feed), so messages never interleave; a reader
    thread answers questions at once and queues commands for the main thread. `outputs` are
    the read ends of the pipes fds 1 and 2 now point at, `copies` the original fds (torchrun's
    log keeps every line too)."""

    def __init__(self, chan: Channel, outputs: dict[Stream, int], copies: dict[Stream, int],
                 on_gone: Callable[[], None]):
        self.chan, self.outputs, self.copies, self.on_gone = chan, outputs, copies, on_gone
        self.lock = threading.Lock()
        self.commands: list = []
        self.ready = threading.Condition()
        self.closed = False

    def start(self, main_thread: int, kept) -> None:
        """Start forwarding output and reading the notebook's messages."""
        threading.Thread(target=self._forward_output, name="ddp_helpers-output",
                         daemon=True).start()
        threading.Thread(target=self._read, args=(main_thread, kept), name="ddp_helpers-commands",
                         daemon=True).start()

    # -- rank -> notebook ---------------------------------------------------------------------

    def send(self, message) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """A reply: first whatever output is still in the pipes, so that it arrives before."""
        with self.lock:
            self.forward_pending()
            self.chan.send_encoded(data)

    def feed_ledger(self, call) -> None:
        """The ledger's on_call, before each collective runs, on the thread that calls it. The
        line goes out at once: a rank that gloo aborts (a shape mismatch) dies within
        milliseconds, and a line still held in this process would die with it, while one in
        the socket's buffer reaches the notebook. (Held back and sent in batches, a loop's
        shape mismatch ended as "rank 0 died" in 1 of 3 tries; sent at once, named in 6 of 6.)"""
        data = encode(Output(Stream.LEDGER, ledger_line.encode(call)))
        try:
            with self.lock:  # output still in the pipes may follow it: it is not a reply
                self.chan.send_encoded(data)
        except (OSError, ValueError):
            pass  # the notebook is gone: the reader thread ends the rank

    def forward_pending(self) -> None:
        """Send what the output pipes hold now (call with the lock held)."""
        for stream, fd in self.outputs.items():
            while True:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not data:
                    break
                os.write(self.copies[stream], data)
                self.chan.send(Output(stream, data))

    def _forward_output(self) -> None:
        fds = list(self.outputs.values())
        while not self.closed:
            ready, _, _ = select.select(fds, [], [], 0.5)
            if ready:
                try:
                    with self.lock:
                        self.forward_pending()
                except (OSError, ValueError):
                    return

    # -- notebook -> rank ---------------------------------------------------------------------

    def _read(self, main_thread: int, kept) -> None:
        """Answer questions at once (the main thread may be in a collective); queue the rest.
        The connection closing means the notebook is gone: `on_gone` ends the rank."""
        while True:
            try:
                message = self.chan.recv()
            except Unreadable as e:
                message = e
            except (EOFError, OSError):
                self.on_gone()
                return
            if isinstance(message, Question):
                with contextlib.suppress(OSError, ValueError):
                    self.send(answer(message, main_thread, kept.describe()))
                continue
            with self.ready:
                self.commands.append(message)
                self.ready.notify()

    def recv(self):
        """The next command (an Unreadable is raised as it would be from a pipe)."""
        with self.ready:
            while not self.commands:
                self.ready.wait()
            message = self.commands.pop(0)
        if isinstance(message, Unreadable):
            raise message
        return message

    def close(self) -> None:
        """After the last reply: send what output is left, stop forwarding."""
        with self.lock:
            with contextlib.suppress(OSError, ValueError):
                self.forward_pending()
        self.closed = True
