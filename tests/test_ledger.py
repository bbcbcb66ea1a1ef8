"""The ledger (ddp_helpers.ledger) on real gloo ranks: what it records for each kind of call,
including the ways a learner can call a collective without writing `dist.all_reduce`."""

import pytest

from ddp_helpers import Ranks

CELL = """
import torch, torch.distributed as dist
from torch.distributed import all_reduce as ar
from ddp_helpers.ledger import Ledger
t = torch.ones(4)
sub = dist.new_group([0])
with Ledger() as ledger:
    dist.all_reduce(t)
    ar(t)
    dist.broadcast(t.double(), src=0)
    dist.barrier()
    if rank == 0:
        dist.all_reduce(t[:2], group=sub)
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
texts = [c.text() for c in ledger.calls]
lines = [c.where[1] for c in ledger.calls]
summary = ledger.text()
with Ledger() as rooted:  # src / dst: as ranks of the group, on the tap as on the mode
    with Ledger(tap=True) as tapped:
        dist.broadcast(t, src=1)
        dist.reduce(t, dst=1)
        dist.gather(t, [torch.ones(4), torch.ones(4)] if rank == 0 else None, dst=0)
        dist.scatter(t, [torch.ones(4), torch.ones(4)] if rank == 1 else None, src=1)
        dist.all_reduce(t)
roots = [[(c.op, c.root) for c in led.calls] for led in (rooted, tapped)]
"""


@pytest.fixture(scope="module")
def recorded():
    with Ranks(2, timeout=60) as pool:
        pool.run(CELL, output="none")
        yield pool.get("texts"), pool.get("lines"), pool.get("summary"), pool.get("roots")


def test_every_call_is_recorded_in_order_with_shapes_groups_and_peers(recorded):
    texts, _, _, _ = recorded
    assert texts[0] == ["all_reduce #1 float32[4]", "all_reduce #2 float32[4]",
                        "broadcast #3 float64[4]", "barrier #4",
                        "all_reduce #1 float32[2] in ranks [0]", "send #5 float32[4] to rank 1"]
    assert texts[1] == ["all_reduce #1 float32[4]", "all_reduce #2 float32[4]",
                        "broadcast #3 float64[4]", "barrier #4", "recv #5 float32[4] from rank 0"]


def test_each_call_names_the_cell_line_that_made_it(recorded):
    _, lines, _, _ = recorded
    assert lines[0] == [8, 9, 10, 11, 13, 14]  # line numbers within CELL (its first is blank)
    assert lines[1][-1] == 16


def test_summary_counts_calls_and_bytes(recorded):
    _, _, text, _ = recorded
    assert text[1] == ("all_reduce x2 (32 B), barrier x1 (0 B), broadcast x1 (32 B), "
                       "recv x1 (16 B)")


def test_rooted_calls_record_their_root(recorded):
    # what the mismatch check compares: every rank must give the same src or dst
    _, _, _, roots = recorded
    expected = [("broadcast", 1), ("reduce", 1), ("gather", 0), ("scatter", 1),
                ("all_reduce", None)]
    assert roots == [[expected, expected]] * 2


def test_ddp_reducer_calls_are_seen():
    code = ("import torch\nfrom ddp_helpers.collectives import count_collectives\n"
            "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))\n"
            "counts = count_collectives(lambda: m(torch.ones(2, 3)).sum().backward())\n")
    with Ranks(2, timeout=60) as pool:
        pool.run(code, output="none")
        assert pool.get("counts") == [{"all_reduce": 1}, {"all_reduce": 1}]
