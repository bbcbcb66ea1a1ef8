"""A mismatch in the learner's words: what each of the two ranks is in, side by side (the
call, its tensors and its line), then why that cannot complete (rules.mismatch finds it)."""

from __future__ import annotations

import signal
from collections.abc import Callable

from ...ledger import Call
from ..rules.mismatch import Finding, members


def explain(f: Finding, nprocs: int, place: Callable[[tuple[str, int]], str], now: float,
            finished_word: str = "finished the cell",
            exitcodes: dict[int, int | None] | None = None) -> str:
    """The learner's paragraph: what each of the two ranks is in, side by side, then why. A
    rank gloo aborted (SIGABRT: the data that arrived did not fit) is said to be aborted first."""
    aborted = {r for r, code in (exitcodes or {}).items() if code == -signal.SIGABRT}
    world = " in the world group" if f.kind == "group" else ""
    mine = _in(f.rank, f.call, world, place, aborted)
    if f.kind in ("ops", "shapes", "group", "roots") or (f.kind == "p2p" and f.other_call):
        theirs = _in(f.other, f.other_call, world, place, aborted)
        if f.kind == "group" and members(f.call.group, nprocs) == \
                members(f.other_call.group, nprocs):
            theirs += " (another group of the same ranks: each new_group call makes one)"
    else:
        n = f.other_count
        theirs = (f"rank {f.other} {finished_word} after {n} collective{'s' * (n != 1)}"
                  + (f" in {f.call.group}" if f.call.group != "world" else "")
                  + f" ({n} against {f.call.seq})" if n and f.kind != "p2p" else
                  f"rank {f.other} {finished_word}" + ("" if f.kind == "p2p" else
                                                       " without calling it"))
    head = (f"Collectives do not match (seen after {max(now - f.since, 0):.1f} s): "
            f"{mine}; {theirs}.")
    why = _WHY[f"ops-{f.hint}" if f.kind == "ops" and f.hint else f.kind]
    few_is_mine = f.fewer == f.rank
    return head + " " + why.format(
        r=f.rank, o=f.other, a=f.call.tensors() or "none",
        b=f.other_call.tensors() if f.other_call else "", op=f.call.op, g=f.call.group,
        ra=f.call.root, rb=f.other_call.root if f.other_call else None,
        oop=f.other_call.op if f.other_call else "", k=f.call.seq, few=f.fewer,
        many=f.other if few_is_mine else f.rank,
        rep=(f.other_call.op if few_is_mine else f.call.op) if f.other_call else "",
        fop=(f.call.op if few_is_mine else f.other_call.op) if f.other_call else "")


def _in(rank: int, call: Call, world: str, place, aborted: set[int]) -> str:
    text = f"{call.text()}{world if call.group == 'world' else ''} ({place(call.where)})"
    if rank in aborted:
        return f"gloo aborted rank {rank} (SIGABRT: the data that arrived did not fit) in {text}"
    return f"rank {rank} is in {text}"


def unmatched_warning(f: Finding, place: Callable[[tuple[str, int]], str]) -> str:
    """The warning for a cell every rank finished although its collectives do not pair."""
    what = (f"rank {f.rank} called {f.call.text()} ({place(f.call.where)}) where rank "
            f"{f.other} " + (f"called {f.other_call.text()} ({place(f.other_call.where)})"
                             if f.other_call else f"made only {f.other_count} collectives"))
    return (f"ddp_helpers: warning: every rank finished this cell, but their collectives do "
            f"not pair: {what}. A collective that returned before it completed (NCCL's do, as "
            "does any async_op=True call not waited on), or one whose error was caught, leaves "
            "the group out of step: the next call that needs it hangs or mixes data. Make every "
            "rank call the same collectives, and wait() on async ones.")


_WHY = {
    "ops": ("The collective of the same number pairs up across ranks, so every rank must call "
            "the same collectives in the same order: here one rank calls a different op, or "
            "the same ops in another order (a rank blocked in its first call has not entered "
            "the next, so the ledgers cannot tell these two apart)."),
    "ops-order": ("Both ranks call {op} and {oop}, in another order: the collective of the same "
                  "number pairs up across ranks, so every rank must call them in one order."),
    "ops-fewer": ("Rank {few} made fewer {rep} calls than rank {many}, so its {fop} met rank "
                  "{many}'s {rep} #{k}: a loop that ran once less on it, as with uneven data (a "
                  "rank with a batch fewer). Every rank must make the same number of "
                  "collectives: agree on the number of steps first (an all_reduce of each "
                  "rank's count with ReduceOp.MIN), or, with a DDP model, run the loop under "
                  "`with model.join():` (Join covers DDP's own collectives only)."),
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
    "p2p": ("A {op} waits for the matching call on its peer, and rank {o} is past any point "
            "where it could make one: every send needs a recv on its peer (and every recv a "
            "send), reached before the peer moves on."),
}
