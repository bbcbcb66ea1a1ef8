"""Lesson 10's exercises: plausible wrong answers FAIL naming the case, correct ones written
differently PASS. zero1 is checked on 3 ranks, on the lesson's MLP and on a 139-parameter model
that no world size divides, and on the ledger: the gradients reduced before optimizer.step(),
the updated slices all-gathered (or broadcast by their owners) after it, and Adam's state the
size of one slice; an answer that steps every parameter on every rank gets DDP's result and
still FAILs. The predictions: wrong counts FAIL, other spellings of the right ones PASS."""

import pytest
from conftest import solution_edit as edit
from exercise_support import assert_all_fail, assert_all_pass, verdicts

import ddp_helpers as dh
from ddp_helpers import exercises

ODD = "rank 0: a 139-parameter model (139 parameters, 3 ranks): "
MLP = "rank 0: the lesson's MLP (55,050 parameters, 3 ranks): "
GATHER = "    dist.all_gather(gathered, shard.detach())\n"
REDUCE = exercises.solution_source("zero1").split("    if dist.get_backend()")[1] \
    .split("    shard.grad = mine / world\n")[0]


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(3, output="none", timeout=120) as p:
        yield p


def edits(*pairs: tuple[str, str]) -> str:
    """The kit's zero1 solution with several edits."""
    source = edit("zero1", *pairs[0])
    for old, new in pairs[1:]:
        assert old in source, old
        source = source.replace(old, new)
    return source


NO_SHARDING = '''import torch
import torch.distributed as dist


def make_shard(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).requires_grad_()


def zero1_step(model, shard, optimizer):
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(grads)
    shard.grad = grads / dist.get_world_size()
    optimizer.step()
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(shard[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
'''

OWN_ADAM = exercises.solution_source("zero1").split("def zero1_step")[0] + '''_FULL = {}


def zero1_step(model, shard, optimizer):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    if model not in _FULL:  # every parameter's Adam state, on every rank
        _FULL[model] = torch.optim.Adam(model.parameters(), lr=optimizer.param_groups[0]["lr"])
    _FULL[model].step()
'''

ZERO1_WRONG = {  # label: (answer, text its FAIL must name)
    "the reduction started with async_op=True, stepped on before it finished": (
        edit("zero1", "dist.reduce_scatter(mine, list(grads.chunk(world)))",
             "dist.reduce_scatter(mine, list(grads.chunk(world)), async_op=True)").replace(
            "dist.all_reduce(grads)\n", "dist.all_reduce(grads, async_op=True)\n"),
        "the gradient optimizer.step() saw: this rank's slice of the mean over the ranks"),
    "no sharding: every rank steps the whole vector": (
        NO_SHARDING, MLP + "make_shard(model): this rank's slice: got (55050,), expected (18350,)"),
    "its own Adam over every parameter, the shard ignored": (
        OWN_ADAM, MLP + "Adam state of the optimizer zero1_step is given: got 0 bytes, expected "
                        "146,800: exp_avg and exp_avg_sq of this rank's 18350 elements only"),
    "shards that drop the remainder": (
        edit("zero1", "size = -(-flat.numel() // world)", "size = flat.numel() // world"),
        ODD + "make_shard(model): this rank's slice: got (46,), expected (47,)"),
    "forgets to divide": (edit("zero1", "shard.grad = mine / world", "shard.grad = mine"),
                          MLP + "the gradient optimizer.step() saw: this rank's slice of the "
                                "mean over the ranks: at index"),
    "its own gradient, never reduced": (
        edits(("    if dist.get_backend()" + REDUCE, ""),
              ("shard.grad = mine / world", "shard.grad = grads.chunk(world)[rank]")),
        MLP + "the gradient optimizer.step() saw: this rank's slice of the mean over the "
              "ranks: at index 0"),
    "never gathers the other slices": (
        edit("zero1", GATHER, "    gathered = [shard.detach()] * world\n"),
        MLP + "collectives after optimizer.step(): called no collective; expected one "
              "all_gather of float32[18350]"),
    "broadcasts every slice from rank 0": (
        edit("zero1", "    gathered = [torch.empty_like(shard) for _ in range(world)]\n" + GATHER,
             "    gathered = [shard.detach().clone() for _ in range(world)]\n"
             "    for r in range(world):\n        dist.broadcast(gathered[r], src=0)\n"),
        MLP + "parameters after 5 Adam steps, against DDP: at index"),
    "takes the mirrored rank's slice": (
        edit("zero1", "return flat[rank * size:(rank + 1) * size]",
             "return flat[(world - 1 - rank) * size:(world - rank) * size]"),
        MLP + "make_shard(model): this rank's slice: at index 0"),
    "rebinds the loop variable instead of copying": (
        edit("zero1", "p.copy_(flat[offset:offset + p.numel()].view_as(p))",
             "p = flat[offset:offset + p.numel()].view_as(p)"),
        MLP + "parameters after 5 Adam steps, against DDP: at index"),
    "shares the slices by all-reducing a zero-filled vector": (
        edit("zero1", "    gathered = [torch.empty_like(shard) for _ in range(world)]\n" + GATHER
             + "    flat, offset = torch.cat(gathered), 0\n",
             "    flat, offset = torch.zeros(shard.numel() * world), 0\n"
             "    flat[rank * shard.numel():(rank + 1) * shard.numel()] = shard.detach()\n"
             "    dist.all_reduce(flat)\n"),
        MLP + "collectives after optimizer.step(): called all_reduce #2 float32[55050]; "
              "expected one all_gather of float32[18350]"),
}

TENSOR_FORMS = '''import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def make_shard(model):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = parameters_to_vector(model.parameters()).detach()
    padded = torch.zeros(-(-flat.numel() // world) * world, device=flat.device)
    padded[:flat.numel()] = flat
    return padded.chunk(world)[rank].clone().requires_grad_()


def zero1_step(model, shard, optimizer):
    world = dist.get_world_size()
    flat = parameters_to_vector(p.grad for p in model.parameters())
    grads = torch.zeros(shard.numel() * world, device=shard.device)
    grads[:flat.numel()] = flat / world  # the mean: divided first, then summed
    dist.all_reduce(grads)
    shard.grad = grads.chunk(world)[dist.get_rank()].clone()
    optimizer.step()
    shard.grad = None  # the slice's gradient is not needed until the next step
    whole = torch.empty(shard.numel() * world, device=shard.device)
    dist.all_gather_into_tensor(whole, shard.detach())
    vector_to_parameters(whole[:flat.numel()], model.parameters())
'''

BROADCASTS = '''import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def make_shard(model):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    size = math.ceil(flat.numel() / world)
    return F.pad(flat, (0, size * world - flat.numel())).narrow(0, rank * size, size).clone() \\
        .requires_grad_(True)


def zero1_step(model, shard, optimizer):
    world, rank, size = dist.get_world_size(), dist.get_rank(), shard.numel()
    for p in model.parameters():  # one all-reduce per tensor: correct, if not the fastest
        dist.all_reduce(p.grad)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()]) / world
    shard.grad = F.pad(grads, (0, size * world - grads.numel()))[rank * size:][:size].clone()
    optimizer.step()
    slices = [shard.detach().clone() if r == rank else torch.empty_like(shard)
              for r in range(world)]
    for owner in range(world):  # each slice from the rank that stepped it
        dist.broadcast(slices[owner], src=owner)
    flat = torch.cat(slices)
    with torch.no_grad():
        for p, new in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()]
                                                         + [flat.numel() - grads.numel()])):
            p.copy_(new.view_as(p))
'''

ZERO1_RIGHT = {"tensor collectives, parameters_to_vector, the gradient freed": TENSOR_FORMS,
               "one all-reduce per tensor, a broadcast from each owner": BROADCASTS,
               "the kit's solution": exercises.solution_source("zero1")}


RACED = "the reduction started with async_op=True, stepped on before it finished"


def test_wrong_zero1_fail_naming_the_case(pool, tmp_path):
    lines = verdicts("zero1", {k: src for k, (src, _) in ZERO1_WRONG.items()}, tmp_path, pool)
    raced = lines.pop(RACED)
    assert_all_fail("zero1", lines, {k: named for k, (_, named) in ZERO1_WRONG.items()
                                     if k != RACED})
    # The race is forced (rank 0 calls last), so the answer always FAILs; which case shows it
    # first depends on when rank 0's own reduction finished: usually the gradient its step saw,
    # under load the parameters that ranks 1.. then spread through the all-gather.
    assert raced.startswith("FAIL zero1: ") and (
        ZERO1_WRONG[RACED][1] in raced or "parameters after 5 Adam steps, against DDP" in raced)


def test_zero1_written_differently_passes(pool, tmp_path):
    assert_all_pass("zero1", verdicts("zero1", ZERO1_RIGHT, tmp_path, pool))


BUCKETS_WRONG = {  # label: (prediction, text its FAIL must name)
    "one bucket per layer, two per bucket at 0.1": ([5, 3, 1], "bucket_cap_mb=0.05: got 5"),
    "the first step's single bucket": ([1, 1, 1], "bucket_cap_mb=0.05: got 1, expected 4"),
    "the caps read backwards": ([1, 2, 4], "bucket_cap_mb=0.05: got 1"),
    "0.1 MiB read as one block per bucket": ([4, 3, 1], "bucket_cap_mb=0.1: got 3, expected 2"),
    "the last layer in a bucket of its own": ([5, 2, 1], "bucket_cap_mb=0.05: got 5"),
    "a fraction": ([4, 2.5, 1], "bucket_cap_mb=0.1: got 2.5"),
    "two counts for three caps": ([4, 2], "the prediction: got [4, 2], expected a list of 3"),
    "a string": ("4, 2, 1", "the prediction: got '4, 2, 1'"),
}
BUCKETS_RIGHT = {"a list": [4, 2, 1], "a tuple": (4, 2, 1), "floats": [4.0, 2.0, 1.0]}

FSDP2_WRONG = {
    "no all-gather again in backward": ({"all_gather": 4, "reduce_scatter": 4},
                                        "all_gather per step: got 4, expected 7"),
    "the root resharded too": ({"all_gather": 8, "reduce_scatter": 4},
                               "all_gather per step: got 8, expected 7"),
    "the root forgotten": ({"all_gather": 6, "reduce_scatter": 3},
                           "all_gather per step: got 6, expected 7"),
    "a reduce-scatter per all-gather": ({"all_gather": 7, "reduce_scatter": 7},
                                        "reduce_scatter per step: got 7, expected 4"),
    "gradients all-reduced, as DDP": ({"all_gather": 7, "all_reduce": 4},
                                      "reduce_scatter per step: got None, expected 4"),
    "an all-reduce as well": ({"all_gather": 7, "reduce_scatter": 4, "all_reduce": 1},
                              "all_reduce per step (FSDP2 calls none): got 1, expected 0"),
    "a pair, not a dict": ((7, 4), "the prediction: got (7, 4), expected a dict"),
    "one name twice": ({"all_gather": 7, "allgather": 7, "reduce_scatter": 4},
                       "the prediction: 'allgather' names all_gather a second time"),
}
FSDP2_RIGHT = {"the dict": {"all_gather": 7, "reduce_scatter": 4},
               "the other order, floats": {"reduce_scatter": 4.0, "all_gather": 7.0},
               "hyphens and capitals": {"All-Gather": 7, "reduce-scatter": 4},
               "torch's names, a zero for all_reduce": {"allgather": 7, "reducescatter": 4,
                                                         "all_reduce": 0},
               "dict()": dict(all_gather=7, reduce_scatter=4)}


@pytest.mark.parametrize("name, wrong", [("ddp_buckets", BUCKETS_WRONG),
                                         ("fsdp2_collectives", FSDP2_WRONG)])
def test_wrong_predictions_fail_naming_the_case(name, wrong, tmp_path):
    lines = verdicts(name, {k: v for k, (v, _) in wrong.items()}, tmp_path)
    assert_all_fail(name, lines, {k: named for k, (_, named) in wrong.items()})


@pytest.mark.parametrize("name, right", [("ddp_buckets", BUCKETS_RIGHT),
                                         ("fsdp2_collectives", FSDP2_RIGHT)])
def test_predictions_spelled_differently_pass(name, right, tmp_path):
    assert_all_pass(name, verdicts(name, right, tmp_path))
