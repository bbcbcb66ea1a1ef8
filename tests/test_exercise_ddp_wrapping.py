"""Lesson 03's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. bucketed_average_gradients is checked on the ledger: one all_reduce of every
gradient's bytes, whatever name it was imported under."""

import pytest
from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

import ddp_helpers as dh

ONE = "    dist.all_reduce(bucket)\n    bucket /= world_size\n"


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(3, output="none", timeout=60) as p:
        yield p


BUCKET_WRONG = {  # label: (answer, text its FAIL must name)
    "one all_reduce per tensor, imported by name": (
        "from torch.distributed import all_reduce\n\n\n"
        "def bucketed_average_gradients(model, world_size):\n"
        "    for p in model.parameters():\n        all_reduce(p.grad)\n"
        "        p.grad /= world_size\n",
        "tiny_model: collectives: called all_reduce #1 float32[8, 4], all_reduce #2"),
    "no division": (edit("bucketed_average_gradients", ONE, "    dist.all_reduce(bucket)\n"),
                    "tiny_model: gradients: at index"),
    "the mean computed, never copied back": (
        edit("bucketed_average_gradients", "        g.copy_(", "        g.clone().copy_("),
        "tiny_model: gradients: at index"),
    "copied back in reverse order": (
        edit("bucketed_average_gradients", "    for g in grads:\n", "    for g in grads[::-1]:\n"),
        "tiny_model: gradients"),
    "async_op=True, never waited": (  # rank 0 joins last: the race is certain
        edit("bucketed_average_gradients", "dist.all_reduce(bucket)",
             "dist.all_reduce(bucket, async_op=True)"), "tiny_model: gradients: at index"),
    "divided by a written-in 2, not world_size (the pool has 3 ranks)": (
        edit("bucketed_average_gradients", ONE, "    dist.all_reduce(bucket)\n    bucket /= 2\n"),
        "tiny_model: gradients: at index"),
    "divided twice": (edit("bucketed_average_gradients", ONE,
                           "    bucket /= world_size\n" + ONE), "tiny_model: gradients: at index"),
    "the first gradient only": (
        edit("bucketed_average_gradients", "grads = [p.grad for p in model.parameters()]",
             "grads = [next(model.parameters()).grad]"),
        "tiny_model: gradients: at index 32"),
    "a gather to rank 0 and a broadcast": (
        edit("bucketed_average_gradients", ONE,
             "    dist.reduce(bucket, dst=0)\n    dist.broadcast(bucket, src=0)\n"
             "    bucket /= world_size\n"), "tiny_model: collectives: called reduce #1"),
}

BUCKET_RIGHT = {
    "torch's flatten helpers, divided first": (
        "import torch.distributed as dist\nfrom torch._utils import _flatten_dense_tensors, "
        "_unflatten_dense_tensors\n\n\ndef bucketed_average_gradients(model, world_size):\n"
        "    grads = [p.grad for p in model.parameters()]\n"
        "    flat = _flatten_dense_tensors(grads).div_(world_size)\n"
        "    dist.all_reduce(flat, op=dist.ReduceOp.SUM)\n"
        "    for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):\n"
        "        g.copy_(mean)\n"),
    "async and waited, div_": edit(
        "bucketed_average_gradients", ONE,
        "    dist.all_reduce(bucket, async_op=True).wait()\n    bucket.div_(world_size)\n"),
}


def test_wrong_bucketed_averages_fail_naming_the_case(pool, tmp_path):
    lines = verdicts("bucketed_average_gradients",
                     {k: src for k, (src, _) in BUCKET_WRONG.items()}, tmp_path, pool)
    assert_all_fail("bucketed_average_gradients", lines,
                    {k: named for k, (_, named) in BUCKET_WRONG.items()})


def test_bucketed_averages_written_differently_pass(pool, tmp_path):
    assert_all_pass("bucketed_average_gradients",
                    verdicts("bucketed_average_gradients", BUCKET_RIGHT, tmp_path, pool))


SHARD = "    return indices[rank:total:world_size]"
SHARD_WRONG = {
    "no padding": ("def shard_indices(n, rank, world_size):\n"
                   "    return list(range(rank, n, world_size))\n", "n=11, world_size=2, rank 1"),
    "contiguous blocks": (edit("shard_indices", SHARD, "    size = total // world_size\n"
                               "    return indices[rank * size:(rank + 1) * size]"),
                          "n=10, world_size=2, rank 0"),
    "padding with the last index": (
        edit("shard_indices", "(list(range(n)) * math.ceil(total / n))[:total]",
             "list(range(n)) + [n - 1] * (total - n)"), "n=11, world_size=2, rank 1"),
    "padding repeated once only": (
        edit("shard_indices", "(list(range(n)) * math.ceil(total / n))[:total]",
             "list(range(n)) + list(range(n))[:total - n]"), "n=2, world_size=5, rank 4"),
    "dropping the remainder": (edit("shard_indices", "math.ceil(n / world_size)",
                                    "(n // world_size)"), "n=11, world_size=2, rank 0"),
    "padding with zeros": (edit("shard_indices", "(list(range(n)) * math.ceil(total / n))[:total]",
                                "list(range(n)) + [0] * (total - n)"), "n=5, world_size=4, rank 2"),
}

SHARD_RIGHT = {
    "modulo arithmetic": ("def shard_indices(n, rank, world_size):\n"
                          "    per_rank = -(-n // world_size)\n"
                          "    return [(rank + i * world_size) % n for i in range(per_rank)]\n"),
    "itertools.cycle": ("import itertools\n\n\ndef shard_indices(n, rank, world_size):\n"
                        "    total = (n + world_size - 1) // world_size * world_size\n"
                        "    padded = list(itertools.islice(itertools.cycle(range(n)), total))\n"
                        "    return padded[rank::world_size]\n"),
}


def test_wrong_shards_fail_naming_the_case(pool, tmp_path):
    lines = verdicts("shard_indices", {k: src for k, (src, _) in SHARD_WRONG.items()},
                     tmp_path, pool)
    assert_all_fail("shard_indices", lines, {k: named for k, (_, named) in SHARD_WRONG.items()})


def test_shards_written_differently_pass(pool, tmp_path):
    assert_all_pass("shard_indices", verdicts("shard_indices", SHARD_RIGHT, tmp_path, pool))
