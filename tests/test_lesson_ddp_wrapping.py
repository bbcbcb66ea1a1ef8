"""Lesson 03: the numbers the notebook shows, from real gloo ranks on loopback."""

import pytest
import torch
from torch.utils.data import DistributedSampler

import ddp_helpers as dh
from ddp_helpers.lessons import ddp_wrapping as w
from ddp_helpers.solutions.bucketed_average_gradients import bucketed_average_gradients
from ddp_helpers.solutions.shard_indices import shard_indices

TOLERANCE = 1e-6  # the notebook states the same: float32 sums taken in a different order


def run(fn, *args, nprocs=2, **kw):
    return dh.launch(fn, args=(nprocs, *args), nprocs=nprocs, timeout=120, output="none", **kw)


def test_constructor_broadcasts_rank0_parameters(no_leftovers):
    r0, r1 = run(w.broadcast_on_wrap)
    assert not torch.equal(r0["before"], r1["before"])
    assert torch.equal(r0["after"], r1["after"])
    assert torch.equal(r1["after"], r0["before"])  # rank 0's values won


def test_backward_averages_gradients_like_manual_all_reduce(no_leftovers):
    r0, r1 = run(w.gradients_before_and_after_sync)
    assert not torch.allclose(r0["local"], r1["local"])
    mean = (r0["local"] + r1["local"]) / 2
    for rec in (r0, r1):
        torch.testing.assert_close(rec["synced"], rec["manual"], rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(rec["synced"], mean, rtol=0, atol=TOLERANCE)


def test_two_ranks_of_64_step_like_one_process_of_128(no_leftovers):
    r0, r1 = run(w.ddp_training, 5, 128)
    ref = w.single_process_training(5, 128)
    assert torch.equal(r0["params"], r1["params"])
    assert (r0["params"] - ref["params"]).abs().max().item() <= TOLERANCE
    assert not torch.equal(ref["params"], w.flat_params(w.tiny_model(0)))  # it did train


def test_sampler_repeats_epochs_without_set_epoch(no_leftovers):
    without = run(w.sampler_indices, 16, 3, False)
    with_ = run(w.sampler_indices, 16, 3, True)
    for per_rank in (without, with_):
        for epoch in range(3):
            both = per_rank[0][epoch] + per_rank[1][epoch]
            assert sorted(both) == list(range(16))  # disjoint halves that cover the dataset
    assert all(without[r][e] == without[r][0] for r in range(2) for e in range(3))
    assert with_[0][1] != with_[0][0] and with_[0][2] != with_[0][1]
    assert with_[0][0] == without[0][0]  # set_epoch(0) is the sampler's default


@pytest.mark.parametrize("use_no_sync, calls", [(True, 1), (False, 4)])
def test_no_sync_accumulation_counts_and_result(use_no_sync, calls, no_leftovers):
    r0, r1 = run(w.accumulate_gradients, 4, 64, use_no_sync)
    ref = w.single_process_training(1, 64)
    assert r0["allreduce_calls"] == r1["allreduce_calls"] == calls
    assert (r0["params"] - ref["params"]).abs().max().item() <= TOLERANCE


def test_bucket_cap_changes_allreduce_calls(no_leftovers):
    r0, r1 = run(w.allreduce_calls_per_backward, [0.05, 0.1, 0.25, 25], 4)
    assert [d["calls"] for d in r0] == [d["calls"] for d in r1]
    assert [d["calls"][0] for d in r0] == [1, 1, 1, 1]  # DDP's initial single bucket
    assert [d["calls"][-1] for d in r0] == [8, 4, 2, 1]
    assert all(sum(d["bucket_numels"]) == 8 * (128 * 128 + 128) for d in r0)


def test_unused_parameters_error_then_fix(no_leftovers):
    with pytest.raises(dh.RankRaised, match="Expected to have finished reduction") as info:
        run(w.train_with_unused_head, False)
    assert info.value.rank == 0
    assert "find_unused_parameters=True" in info.value.exc_message
    r0, r1 = run(w.train_with_unused_head, True)
    assert len(r0["losses"]) == len(r1["losses"]) == 2


@pytest.mark.parametrize("average", [w.average_gradients_by_hand, bucketed_average_gradients])
def test_ddp_from_primitives_matches_ddp(average, no_leftovers):
    prim = run(w.ddp_from_primitives, 5, 128, 0.1, average)
    ddp = run(w.ddp_training, 5, 128)
    for r in range(2):
        assert (prim[r]["params"] - ddp[r]["params"]).abs().max().item() <= TOLERANCE


def test_save_on_rank0_load_everywhere(tmp_path, no_leftovers):
    recs = run(w.save_on_rank0_load_everywhere, str(tmp_path / "model.pt"))
    assert recs[0]["ddp_keys"][0] == "module.0.weight"
    assert recs[0]["saved_keys"][0] == "0.weight"
    for rec in recs:
        assert torch.equal(rec["loaded"], recs[0]["trained"])


@pytest.mark.parametrize("n", [10, 11, 16])
@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_indices_solution_matches_distributed_sampler(n, world_size):
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False)
        assert shard_indices(n, rank, world_size) == list(sampler)
