"""Lesson 03: the facts the notebook shows, from the same lines run on real gloo ranks."""

import textwrap

import pytest
import torch
from torch.utils.data import DistributedSampler

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import ddp_wrapping as lesson
from ddp_helpers.solutions.shard_indices import shard_indices

TOLERANCE = 1e-6  # the notebook states the same: float32 sums taken in another order

IMPORTS = """
import contextlib
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
import ddp_helpers as dh
from ddp_helpers.lessons import ddp_wrapping as lesson
from ddp_helpers.models import param_digest
"""


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(2, backend="gloo", output="none") as ranks:
        ranks.run(IMPORTS)
        yield ranks


def run(pool, code: str, **kw) -> list:
    return pool.run(textwrap.dedent(code), **kw)


def test_wrapping_broadcasts_rank0_parameters(pool):
    before = run(pool, """
        torch.manual_seed(rank)
        model = lesson.tiny_model().to(device)
        param_digest(model)
        """)
    after = run(pool, """
        model = DDP(model, device_ids=dh.device_ids(device))
        param_digest(model.module)
        """)
    assert before[0] != before[1]
    assert after == [before[0], before[0]]


def test_backward_averages_gradients_and_a_step_keeps_ranks_equal(pool):
    run(pool, """
        torch.manual_seed(rank)
        model = DDP(lesson.tiny_model().to(device), device_ids=dh.device_ids(device))
        x, y = lesson.rank_batch(0, 16, rank, world_size, device)
        with model.no_sync():
            F.cross_entropy(model(x), y).backward()
        local = lesson.flat_grads(model)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        synced = lesson.flat_grads(model)
        """)
    local, synced = pool.get("local"), pool.get("synced")
    assert not torch.allclose(local[0], local[1])
    assert torch.equal(synced[0], synced[1])
    torch.testing.assert_close(synced[0], (local[0] + local[1]) / 2, rtol=1e-5, atol=1e-8)
    digests = run(pool, """
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        param_digest(model.module)
        """)
    assert digests[0] == digests[1]


def test_two_ranks_of_64_step_like_one_process_of_128(pool):
    run(pool, """
        trained = DDP(lesson.tiny_model(seed=0).to(device), device_ids=dh.device_ids(device))
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        for step in range(5):
            x, y = lesson.rank_batch(step, 128, rank, world_size, device)
            opt.zero_grad()
            F.cross_entropy(trained(x), y).backward()
            opt.step()
        ddp_params = lesson.flat_params(trained.module)
        """)
    params = pool.get("ddp_params")
    single = lesson.single_process_training(steps=5, batch=128)["params"]
    assert torch.equal(params[0], params[1])
    assert (params[0] - single).abs().max().item() <= TOLERANCE
    assert not torch.equal(single, lesson.flat_params(lesson.tiny_model(0)))  # it did train


def test_sampler_repeats_epochs_without_set_epoch(pool):
    run(pool, """
        sampler = DistributedSampler(range(16), shuffle=True, seed=0)
        without = [list(sampler) for epoch in range(3)]
        with_epoch = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            with_epoch.append(list(sampler))
        """)
    without, with_epoch = pool.get("without"), pool.get("with_epoch")
    assert lesson.epochs_repeat(without) and not lesson.epochs_repeat(with_epoch)
    assert lesson.sampler_covers_every_index(without, 16)
    assert lesson.sampler_covers_every_index(with_epoch, 16)
    assert with_epoch[0][0] == without[0][0]  # set_epoch(0) is the sampler's default


def test_no_sync_makes_one_allreduce_with_the_same_gradient(pool):
    every_time = run(pool, """
        model = DDP(lesson.tiny_model(seed=0).to(device), device_ids=dh.device_ids(device))
        counter = lesson.AllReduceCounter()
        model.register_comm_hook(counter, lesson.counting_allreduce_hook)
        x, y = lesson.rank_batch(0, 64, rank, world_size, device)
        for xm, ym in zip(x.chunk(4), y.chunk(4)):
            (F.cross_entropy(model(xm), ym) / 4).backward()
        every_time = lesson.flat_grads(model)
        counter.calls
        """)
    once = run(pool, """
        counter.reset()
        model.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(4), y.chunk(4))):
            with model.no_sync() if i < 3 else contextlib.nullcontext():
                (F.cross_entropy(model(xm), ym) / 4).backward()
        once = lesson.flat_grads(model)
        counter.calls
        """)
    assert every_time == [4, 4] and once == [1, 1]
    torch.testing.assert_close(pool.get("once")[0], pool.get("every_time")[0],
                               rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("cap, calls, sizes", [
    (None, [1, 1], [132096]),
    (0.1, [1, 4], [33024] * 4),
    (0.05, [1, 8], [16512] * 8),
    (0.15, [1, 3], [49536, 49536, 33024]),  # exercise 3's answer: 3 layers, 3, then 2
])
def test_bucket_cap_sets_the_allreduces_from_the_second_backward(pool, cap, calls, sizes):
    kwargs = "" if cap is None else f", bucket_cap_mb={cap}"
    counts = run(pool, f"""
        model = DDP(lesson.layered_model().to(device), device_ids=dh.device_ids(device){kwargs})
        lesson.count_allreduces(model)
        """)
    expected = {"calls per backward": calls, "bucket sizes": sizes}
    assert counts == [expected, expected]


def test_unused_parameter_ranks_drift_in_step1_and_step2_raises(pool):
    step1 = run(pool, """
        model = DDP(lesson.TwoHeads().to(device), device_ids=dh.device_ids(device))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = lesson.rank_batch(0, 16, rank, world_size, device)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        param_digest(model.module)
        """)
    assert step1[0] != step1[1]  # never averaged
    with pytest.raises(dh.RankRaised, match="Expected to have finished reduction") as info:
        run(pool, """
            x, y = lesson.rank_batch(1, 16, rank, world_size, device)
            F.cross_entropy(model(x), y).backward()
            """)
    assert "every rank keeps its state" in str(info.value)
    assert pool.running


@pytest.mark.parametrize("option", ["find_unused_parameters=True", "static_graph=True"])
def test_unused_parameters_fixed_by_either_option(pool, option):
    digests = run(pool, f"""
        model = DDP(lesson.TwoHeads().to(device), device_ids=dh.device_ids(device), {option})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x, y = lesson.rank_batch(step, 16, rank, world_size, device)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        param_digest(model.module)
        """)
    assert digests[0] == digests[1]


def test_ddp_broadcasts_rank0_buffers_every_forward(pool):
    first = run(pool, """
        bn = DDP(nn.BatchNorm1d(2).to(device), device_ids=dh.device_ids(device))
        xb = lesson.shifted_batch(rank, device)
        bn(xb)
        bn.module.running_mean.tolist()
        """)
    second = run(pool, "bn(xb)\nbn.module.running_mean.tolist()")
    assert first == second == [[0.0, 0.0], [1.0, 1.0]]  # not 1.9: rank 0's were copied first
    means = run(pool, """
        total, count = xb.sum(0), torch.tensor(float(len(xb)), device=device)
        dist.all_reduce(total)
        dist.all_reduce(count)
        (total / count).tolist()
        """)
    assert means == [[5.0, 5.0], [5.0, 5.0]]


def test_sync_batchnorm_is_refused_on_the_cpu(pool):
    with pytest.raises(dh.RankRaised, match="SyncBatchNorm layers only work with GPU modules"):
        run(pool, """
            sync_bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(2))
            sync_bn = DDP(sync_bn.to(device), device_ids=dh.device_ids(device))
            """)


def test_ddp_from_primitives_matches_ddp(pool):
    run(pool, """
        torch.manual_seed(rank)
        plain = lesson.tiny_model().to(device)
        for p in plain.parameters():
            dist.broadcast(p.data, src=0)
        opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        for step in range(5):
            x, y = lesson.rank_batch(step, 128, rank, world_size, device)
            opt.zero_grad()
            F.cross_entropy(plain(x), y).backward()
            lesson.average_gradients_by_hand(plain, world_size)
            opt.step()
        by_hand = lesson.flat_params(plain)
        """)
    by_hand = pool.get("by_hand")
    single = lesson.single_process_training(steps=5, batch=128)["params"]
    assert torch.equal(by_hand[0], by_hand[1])
    assert (by_hand[0] - single).abs().max().item() <= TOLERANCE


def test_save_on_rank0_load_everywhere(pool):
    run(pool, "trained = DDP(lesson.tiny_model(seed=0).to(device), "
              "device_ids=dh.device_ids(device))")
    keys = run(pool, "list(trained.state_dict())[:2], list(trained.module.state_dict())[:2]",
               targets=[0])
    assert keys == [(["module.0.weight", "module.0.bias"], ["0.weight", "0.bias"])]
    loaded = run(pool, """
        import tempfile
        folder = tempfile.TemporaryDirectory() if rank == 0 else None
        path = [f"{folder.name}/model.pt" if rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        if rank == 0:
            torch.save(trained.module.state_dict(), path[0])
        dist.barrier()
        fresh = lesson.tiny_model(seed=123).to(device)
        fresh.load_state_dict(torch.load(path[0], map_location=device, weights_only=True))
        dist.barrier()
        if rank == 0:
            folder.cleanup()
        param_digest(fresh) == param_digest(trained.module)
        """)
    assert loaded == [True, True]


# -- exercises: the kit's solution passes, a stub is not attempted, a wrong answer fails -----

def _define(pool, name: str, body: str) -> None:
    run(pool, f"def {name}(*args):\n    {body}\n")


@pytest.mark.parametrize("name", ["bucketed_average_gradients", "shard_indices"])
def test_exercise_verdicts(pool, name):
    solution = exercises.solution_module(name)
    pool.push(**{name: getattr(solution, name)})
    assert exercises.evaluate(name, pool=pool).outcome == "PASS"
    _define(pool, name, "...")
    assert exercises.evaluate(name, pool=pool).outcome == "NOT ATTEMPTED"
    _define(pool, name, "return None")
    verdict = exercises.evaluate(name, pool=pool)
    assert verdict.outcome == "FAIL" and "expected" in verdict.line


def test_bucketed_average_counts_all_reduce_calls(pool):
    run(pool, """
        def bucketed_average_gradients(model, world_size):
            lesson.average_gradients_by_hand(model, world_size)  # right values, many calls
        """)
    verdict = exercises.evaluate("bucketed_average_gradients", pool=pool)
    assert verdict.outcome == "FAIL" and "one bucket for every gradient" in verdict.line


def test_exercise_shard_cases_need_padding():
    assert any(n % w for n, w in lesson.SHARD_CASES)  # some case pads


@pytest.mark.parametrize("n, world_size", [(10, 2), (11, 2), (11, 3), (5, 4), (1, 3), (2, 5)])
def test_shard_indices_solution_matches_distributed_sampler(n, world_size):
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False)
        assert shard_indices(n, rank, world_size) == list(sampler)
