"""The pipes between the parent and the ranks it forks, from the parent's side: one set per run.

Each rank gets an output pipe for fd 1 and one for fd 2 (so C++ output comes too), a reply
channel, a faulthandler pipe for its stacks, the lifeline shared by every rank and, for
persistent ranks, a command channel and a duplex control channel. Replies, commands and control
questions are wire messages on Channels; the others carry raw bytes (the ledger pipe: one line
per collective a rank enters, wire.ledger_line).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import time

from ..rank.entry import RankSpec
from ..wire.channel import Channel
from ..wire.messages import Stream


class RankPipes:
    """The parent's ends of every pipe of one run, and what each rank takes (its RankSpec)."""

    def __init__(self, ctx, nprocs: int, persistent: bool):
        lifeline_child, self.lifeline = ctx.Pipe(duplex=False)
        self.streams: dict = {}  # output and ledger pipes -> (Stream, rank)
        self.replies: dict[Channel, int] = {}  # reply channels -> rank
        self.stacks: dict[int, object] = {}  # rank -> read end of its faulthandler pipe
        self.commands: dict[int, Channel] = {}
        self.controls: dict[int, Channel] = {}
        self._child: list[dict] = []
        for rank in range(nprocs):
            out_r, out_w = ctx.Pipe(duplex=False)
            err_r, err_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            stk_r, stk_w = ctx.Pipe(duplex=False)
            led_r, led_w = ctx.Pipe(duplex=False)
            self.streams.update({out_r: (Stream.OUT, rank), err_r: (Stream.ERR, rank),
                                 led_r: (Stream.LEDGER, rank)})
            self.replies[Channel(res_r)] = rank
            self.stacks[rank] = stk_r
            cmd_r = control_child = None
            if persistent:
                cmd_r, cmd_w = ctx.Pipe(duplex=False)
                control, control_child = ctx.Pipe(duplex=True)
                self.commands[rank], self.controls[rank] = Channel(cmd_w), Channel(control)
            self._child.append(dict(out=out_w, err=err_w, result=res_w, lifeline=lifeline_child,
                                    stacks=stk_w, commands=cmd_r, control=control_child,
                                    ledger=led_w))

    def specs(self, **common) -> list[RankSpec]:
        """Each rank's spec: its own pipe ends plus `common` (payload, env, sys_path, ...)."""
        return [RankSpec(**common, **ends) for ends in self._child]

    def handed_over(self, specs: list[RankSpec]) -> None:
        """The ranks hold their ends now: close our copies, which would hide EOF."""
        for spec in specs:
            for conn in spec.child_ends():
                conn.close()
        self._child = []

    def forget(self, conn) -> None:
        """A pipe or channel reached EOF: stop watching it."""
        self.streams.pop(conn, None)
        self.replies.pop(conn, None)
        conn.close()

    def close_lifeline(self) -> None:
        """Tell the ranks the parent is done with them: each then kills its process group."""
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None

    def close(self) -> None:
        """Close every end we hold."""
        self.close_lifeline()
        for conn in [*self.streams, *self.replies, *self.commands.values(),
                     *self.controls.values(), *self.stacks.values()]:
            with contextlib.suppress(OSError):
                conn.close()
        self.streams.clear()
        self.replies.clear()
        self.commands.clear()
        self.controls.clear()
        self.stacks.clear()


def read_chunk(conn) -> bytes:
    """What a pipe holds now (b"" at EOF or once it is closed)."""
    try:
        return os.read(conn.fileno(), 65536)
    except OSError:
        return b""


def read_stack_dumps(ends: dict[int, object], seconds: float) -> dict[int, str]:
    """Each rank's faulthandler dump from its stack pipe in `ends`, read for up to `seconds`."""
    texts = {r: b"" for r in ends}
    pending = {conn: r for r, conn in ends.items()}
    deadline = time.monotonic() + seconds
    while pending and time.monotonic() < deadline:
        # Once every rank has written something, a quiet 0.1 s means the dumps are complete.
        quiet = 0.1 if all(texts.values()) else deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(pending), max(quiet, 0))
        if not ready and all(texts.values()):
            break
        for conn in ready:
            chunk = read_chunk(conn)
            texts[pending[conn]] += chunk
            if not chunk:  # EOF: the rank is gone
                del pending[conn]
    return {r: t.decode("utf-8", "replace") for r, t in texts.items()}
