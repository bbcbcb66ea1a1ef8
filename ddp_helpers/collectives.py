"""Counting the collectives a piece of code calls, by name: the lessons that write DDP by hand
(09) and shard it (10) check their versions with it. One mechanism underneath: the ledger
(ddp_helpers.ledger), which sees torch.distributed's ops, DDP's C++ reducer and DTensor alike.
"""

from __future__ import annotations

from collections.abc import Callable

from .ledger import record


def count_collectives(work: Callable[[], object]) -> dict[str, int]:
    """Run work() with the ledger on; return {collective: calls}, e.g. {"all_reduce": 6}."""
    return record(work).counts()


def collective_bytes(work: Callable[[], object]) -> dict[str, tuple[int, int]]:
    """Run work() with the ledger on; return {collective: (calls, bytes this rank handed in)}."""
    return record(work).summary()
