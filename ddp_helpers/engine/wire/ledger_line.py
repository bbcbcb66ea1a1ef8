"""A collective as one line of JSON, by field name: what a rank's ledger feed sends for each
collective it enters (before the op runs) and what the parent reads back.

The fields are ddp_helpers.ledger.Call's (seq, op, group, shapes, dtypes, nbytes, where, peer,
root); a field added there travels without a change here. A line {"dropped": n} says that n
records did not fit in the pipe, so the reader stops trusting that rank's count.
"""

from __future__ import annotations

import dataclasses
import json


def encode(call) -> bytes:
    """A ledger Call (any dataclass) as one JSON line."""
    return json.dumps(dataclasses.asdict(call)).encode() + b"\n"


def encode_dropped(count: int) -> bytes:
    """The line that says `count` records were lost before the next one."""
    return json.dumps({"dropped": count}).encode() + b"\n"


def decode(line: bytes) -> dict | None:
    """A line's fields (lists become tuples, as Call holds them); None for a line that says
    records were dropped, or that cannot be read: the rank's record has a gap."""
    try:
        fields = json.loads(line)
    except ValueError:
        return None
    if not isinstance(fields, dict) or "dropped" in fields:
        return None
    return {k: _tuples(v) for k, v in fields.items()}


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
