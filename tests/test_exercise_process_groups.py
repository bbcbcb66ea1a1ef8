"""Lesson 01's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS, on 3 ranks (the notebook's) and 2. Both are checked on the Ledger: a
collective under any import alias is refused, and a ring must send to one neighbour and receive
from the other, (n-1) chunks in all."""

import pytest
from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, judge, verdicts

import ddp_helpers as dh


@pytest.fixture(scope="module")
def three():
    with dh.Ranks(3, output="none", timeout=60) as p:
        yield p


@pytest.fixture(scope="module")
def two():
    with dh.Ranks(2, output="none", timeout=60) as p:
        yield p


ADD = "            tensor += inbox\n"
NAIVE_WRONG = {  # label: (answer, text its FAIL must name)
    "every rank sends to every other (right sums, not through rank 0)": (
        "import torch\nimport torch.distributed as dist\n\n\ndef naive_all_reduce(tensor):\n"
        "    rank, n = dist.get_rank(), dist.get_world_size()\n    mine = tensor.clone()\n"
        "    reqs = [dist.isend(mine, dst=d) for d in range(n) if d != rank]\n"
        "    inbox = torch.empty_like(tensor)\n    for src in range(n):\n"
        "        if src != rank:\n            dist.recv(inbox, src=src)\n"
        "            tensor += inbox\n    for r in reqs:\n        r.wait()\n    return tensor\n",
        "10 random floats: through rank 0: called send"),
    "all_reduce imported by name": (
        "from torch.distributed import all_reduce\n\n\ndef naive_all_reduce(tensor):\n"
        "    all_reduce(tensor)\n    return tensor\n", "10 random floats: raised _Refused"),
    "all_reduce under an alias": (
        "from torch.distributed import all_reduce as add_up\n\n\n"
        "def naive_all_reduce(tensor):\n    add_up(tensor)\n    return tensor\n",
        "it called all_reduce #1 float32[10]"),
    "sent to rank 0, broadcast back": (
        "import torch\nimport torch.distributed as dist\n\n\ndef naive_all_reduce(tensor):\n"
        "    if dist.get_rank() == 0:\n        inbox = torch.empty_like(tensor)\n"
        "        for src in range(1, dist.get_world_size()):\n"
        "            dist.recv(inbox, src=src)\n            tensor += inbox\n"
        "    else:\n        dist.send(tensor, dst=0)\n    dist.broadcast(tensor, src=0)\n"
        "    return tensor\n", "it called broadcast"),
    "a new tensor on rank 0, not in place": (
        edit("naive_all_reduce", ADD, "            tensor = tensor + inbox\n"),
        "rank 0: 10 random floats (summed in place)"),
    "overwritten instead of added": (
        edit("naive_all_reduce", ADD, "            tensor.copy_(inbox)\n"),
        "10 random floats (summed in place)"),
    "the last message sent back, not the sum": (
        edit("naive_all_reduce", "dist.send(tensor, dst=dst)", "dist.send(inbox, dst=dst)"),
        "rank 1: 10 random floats (summed in place)"),
}

NAIVE_RIGHT = {
    "isend/irecv, rank 0 waits on all": (
        "import torch\nimport torch.distributed as dist\n\n\ndef naive_all_reduce(tensor):\n"
        "    rank, n = dist.get_rank(), dist.get_world_size()\n    if rank == 0:\n"
        "        inboxes = [torch.empty_like(tensor) for _ in range(1, n)]\n"
        "        for req in [dist.irecv(b, src=s) for s, b in enumerate(inboxes, 1)]:\n"
        "            req.wait()\n        for b in inboxes:\n            tensor.add_(b)\n"
        "        for req in [dist.isend(tensor, dst=d) for d in range(1, n)]:\n"
        "            req.wait()\n    else:\n        dist.isend(tensor, dst=0).wait()\n"
        "        dist.irecv(tensor, src=0).wait()\n    return tensor\n"),
    "rank 0 receives last rank first, sums into a new tensor, copies it in": (
        "import torch\nfrom torch.distributed import get_rank, get_world_size, recv, send\n\n\n"
        "def naive_all_reduce(tensor):\n    if get_rank() != 0:\n        send(tensor, 0)\n"
        "        recv(tensor, 0)\n        return tensor\n    total = tensor.clone()\n"
        "    for src in reversed(range(1, get_world_size())):\n"
        "        part = torch.zeros_like(tensor)\n        recv(part, src)\n"
        "        total = total + part\n    tensor.copy_(total)\n"
        "    for dst in range(1, get_world_size()):\n        send(tensor, dst)\n"
        "    return tensor\n"),
}


def test_wrong_naive_all_reduces_fail_naming_the_case(three, tmp_path):
    lines = verdicts("naive_all_reduce", {k: src for k, (src, _) in NAIVE_WRONG.items()},
                     tmp_path, three)
    assert_all_fail("naive_all_reduce", lines, {k: named for k, (_, named) in NAIVE_WRONG.items()})
    assert three.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [3.0] * 3


def test_naive_all_reduces_written_differently_pass(three, two, tmp_path):
    answers = {"the kit's solution": dh.exercises.solution_source("naive_all_reduce"),
               **NAIVE_RIGHT}
    for pool in (three, two):
        assert_all_pass("naive_all_reduce", verdicts("naive_all_reduce", answers, tmp_path, pool))


def test_naive_all_reduce_not_attempted_without_an_answer(three, tmp_path):
    three.run("_ = globals().pop('naive_all_reduce', None)")
    assert dh.exercises.evaluate("naive_all_reduce", pool=three).outcome == "NOT ATTEMPTED"
    assert judge("naive_all_reduce", "x = 1\n", tmp_path, three).outcome == "NOT ATTEMPTED"


STEP = "        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n\n"
STAR = ("import torch\nimport torch.distributed as dist\n\n\ndef ring_all_gather(tensor):\n"
        "    rank, n = dist.get_rank(), dist.get_world_size()\n"
        "    out = torch.empty((n, *tensor.shape), dtype=tensor.dtype)\n    out[rank] = tensor\n"
        "    if rank == 0:\n        for src in range(1, n):\n"
        "            dist.recv(out[src], src=src)\n"
        "        for dst in range(1, n):\n            dist.send(out, dst=dst)\n"
        "    else:\n        dist.send(tensor, dst=0)\n        dist.recv(out, src=0)\n"
        "    return out.reshape(-1)\n")
RING_WRONG = {
    "all_gather under an alias": (
        "import torch\nfrom torch.distributed import all_gather as gather_all\n"
        "from torch.distributed import get_world_size\n\n\ndef ring_all_gather(tensor):\n"
        "    parts = [torch.empty_like(tensor) for _ in range(get_world_size())]\n"
        "    gather_all(parts, tensor)\n    return torch.cat(parts)\n",
        "3 floats per rank: raised _Refused: ring_all_gather must move data with dist.send/recv"
        " or dist.isend/irecv only; it called all_gather"),
    "a star through rank 0": (STAR, "3 floats per rank: the ring: called recv #1"),
    "one step too many": (edit("ring_all_gather", "range(n - 1)", "range(n)"),
                          "3 floats per rank: the ring"),
    "received into the wrong slot": (
        edit("ring_all_gather", STEP,
             "        send_i, recv_i = (rank - step) % n, (rank + step + 1) % n\n"),
        "3 floats per rank"),
    "own tensor never placed": (
        edit("ring_all_gather", "    out[rank] = tensor\n", "").replace("torch.empty(",
                                                                         "torch.zeros("),
        "3 floats per rank"),
    "stacked, not concatenated": (edit("ring_all_gather", "return out.reshape(-1)", "return out"),
                                  "3 floats per rank"),
}

RING_RIGHT = {
    "the other direction": edit(
        "ring_all_gather", STEP + "        req = dist.isend(out[send_i].contiguous(), dst=right)\n"
        "        dist.recv(out[recv_i], src=left)\n",
        "        send_i, recv_i = (rank + step) % n, (rank + step + 1) % n\n"
        "        req = dist.isend(out[send_i].contiguous(), dst=left)\n"
        "        dist.recv(out[recv_i], src=right)\n"),
    "a list of chunks, irecv, torch.cat": (
        "import torch\nimport torch.distributed as dist\n\n\ndef ring_all_gather(tensor):\n"
        "    rank, n = dist.get_rank(), dist.get_world_size()\n"
        "    chunks = [torch.empty_like(tensor) for _ in range(n)]\n    chunks[rank] = tensor\n"
        "    for step in range(n - 1):\n"
        "        s = dist.isend(chunks[(rank - step) % n], dst=(rank + 1) % n)\n"
        "        r = dist.irecv(chunks[(rank - step - 1) % n], src=(rank - 1) % n)\n"
        "        r.wait()\n        s.wait()\n    return torch.cat(chunks)\n"),
}


def test_wrong_ring_all_gathers_fail_naming_the_case(three, tmp_path):
    lines = verdicts("ring_all_gather", {k: src for k, (src, _) in RING_WRONG.items()},
                     tmp_path, three)
    assert_all_fail("ring_all_gather", lines, {k: named for k, (_, named) in RING_WRONG.items()})
    assert three.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [3.0] * 3


def test_ring_all_gathers_written_differently_pass(three, two, tmp_path):
    answers = {"the kit's solution": dh.exercises.solution_source("ring_all_gather"), **RING_RIGHT}
    for pool in (three, two):
        assert_all_pass("ring_all_gather", verdicts("ring_all_gather", answers, tmp_path, pool))


def test_ring_all_gather_not_attempted_without_an_answer(three, tmp_path):
    three.run("_ = globals().pop('ring_all_gather', None)")
    assert dh.exercises.evaluate("ring_all_gather", pool=three).outcome == "NOT ATTEMPTED"
