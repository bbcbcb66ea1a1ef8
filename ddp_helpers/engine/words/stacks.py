"""Each rank's stack at one moment, in the learner's names: what `%ranks where` prints, what a
stopped pool keeps for `%ranks debug R`, and what an error that stopped the ranks carries as
`err.where[rank]`."""

from __future__ import annotations

from ...ledger import Call
from ..wire.messages import FrameLocals, Stack
from .places import Labels


class Snapshot(dict):
    """{rank: Stack, or None for a rank that did not answer}, printed one rank after another.
    `entered` is the last collective each rank entered (from its ledger), `exited` the ranks
    whose process had gone, `when` what the moment was ("when the kit stopped the ranks")."""

    def __init__(self, stacks: dict[int, Stack | None], labels: Labels, *, when: str,
                 entered: dict[int, Call] | None = None, exited=()):
        super().__init__(stacks)
        self.labels, self.when = labels, when
        self.entered = entered or {}
        self.exited = set(exited)

    def text(self, rank: int) -> str:
        """One rank's part: where it was, then each of its frames with their variables."""
        if rank in self.exited:
            return f"rank {rank}: had exited"
        info = self.get(rank)
        if info is None:
            return (f"rank {rank}: did not answer (busy in C++ code that holds the GIL, or "
                    "gone)")
        keeps = f"\n  keeps for post-mortem (%ranks debug {rank}): {info.failure}" \
            if info.failure else ""
        if info.idle:
            return f"rank {rank}: idle, between cells" + keeps
        lines = [f"rank {rank}: {self._head(rank, info)}"]
        for frame in info.frames:
            lines += self._frame(frame)
        return "\n".join(lines) + keeps

    def _head(self, rank: int, info: Stack) -> str:
        call = self.entered.get(rank)
        if info.call is None and not info.in_comm:
            return "running the learner's code"
        head = f"in {info.call or 'a wait'}"
        if call is not None:
            head += f" (it entered {call.text()} at {self.labels.place(call.where)})"
        if info.call_values:
            head += ", handed " + ", ".join(f"{v.name} = {v.text}" for v in info.call_values)
        return head

    def _frame(self, frame: FrameLocals) -> list[str]:
        f = frame.frame
        inside = "" if f.function == "<module>" else f", in {f.function}"
        out = [f"  {self.labels.place((f.file, f.line))}{inside}: {f.text}"]
        out += [f"      {v.name} = {v.text}" for v in frame.values]
        return out

    def __str__(self) -> str:
        ranks = sorted(set(self) | self.exited)
        return f"Each rank's stack {self.when}, most recent call last:\n" + \
            "\n".join(self.text(r) for r in ranks)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))
