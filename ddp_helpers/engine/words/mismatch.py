"""A mismatch in the learner's words: what each of the two ranks is in, side by side (the
call, its tensors and its line), then why that cannot complete (rules.mismatch finds it)."""

from __future__ import annotations

import signal
from collections.abc import Callable

from ...ledger import Call
from ..rules.mismatch import Finding


def explain(f: Finding, nprocs: int, place: Callable[[tuple[str, int]], str], now: float,
            finished_word: str = "finished the cell") -> str:
    """The learner's paragraph: what each of the two ranks is in, side by side, then why."""
    world = " in the world group" if f.kind == "group" else ""
    mine = f"rank {f.rank} is in {_text(f.call, world)} ({place(f.call.where)})"
    if f.kind in ("ops", "shapes", "group", "roots"):
        theirs = (f"rank {f.other} is in {_text(f.other_call, world)} "
                  f"({place(f.other_call.where)})")
    else:
        n = f.other_count
        theirs = (f"rank {f.other} {finished_word} after {n} collective{'s' * (n != 1)}"
                  + (f" in {f.call.group}" if f.call.group != "world" else "")
                  + f" ({n} against {f.call.seq})" if n else
                  f"rank {f.other} {finished_word} without calling it")
    head = (f"Collectives do not match (seen after {max(now - f.since, 0):.1f} s): "
            f"{mine}; {theirs}.")
    return head + " " + _WHY[f.kind].format(r=f.rank, o=f.other, a=f.call.tensors() or "none",
                                            b=f.other_call.tensors() if f.other_call else "",
                                            op=f.call.op, g=f.call.group, ra=f.call.root,
                                            rb=f.other_call.root if f.other_call else None)


def _text(call: Call, world: str) -> str:
    return call.text() + (world if call.group == "world" else "")


_WHY = {
    "ops": ("The collective of the same number pairs up across ranks, so every rank must call "
            "the same collectives in the same order: here one rank calls a different op, or "
            "the same ops in another order."),
    "shapes": ("The same collective got different tensors: {a} on rank {r}, {b} on rank {o}. "
               "Every rank must hand in the same shapes and dtypes."),
    "roots": ("The same {op} was given a different root on each rank: {ra} on rank {r}, {rb} on "
              "rank {o} (ranks of its group). Every rank must pass the same src (dst for reduce "
              "and gather), the one rank that holds or receives the data, not its own rank."),
    "fewer": ("Rank {o} made fewer calls, so rank {r}'s {op} has no partner: every rank must "
              "make the same number of collectives (a loop or an `if` that depends on the "
              "rank?)."),
    "never": ("Rank {o} never reached the {op}: a collective completes only when every rank "
              "of its group calls it (an `if rank == ...` around it?)."),
    "group": ("The ranks are in collectives of different groups ({g} for rank {r}): every "
              "member of a group must call its collectives, in the same order as the others."),
}


def aborted_note(exitcodes: dict[int, int]) -> str:
    """For ranks gloo aborted (SIGABRT) because what arrived did not fit: say so."""
    aborted = sorted(r for r, code in exitcodes.items() if code == -signal.SIGABRT)
    if not aborted:
        return ""
    return (f" (gloo aborted rank(s) {', '.join(map(str, aborted))}, SIGABRT, when the data that "
            "arrived did not fit.)")
