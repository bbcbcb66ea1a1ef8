"""Lesson 12's broken programs do what the notebook says, on real gloo ranks: the skipped
collective, the shapes and the extra batch are named as mismatches with the snapshot holding
the caller's locals; the NaN is on one rank's batch only; compare names what differs."""

import pytest

import ddp_helpers as dh
from ddp_helpers.lessons import debugging_lab as lesson

IMPORT = "from ddp_helpers.lessons import debugging_lab as lesson\n"


@pytest.fixture
def pool():
    """Fresh ranks per test: a mismatch makes the pool start new ones, which a module-scoped
    pool would leave to outlive the test."""
    with dh.Ranks(2, timeout=60, output="none") as p:
        yield p


def test_the_skipped_all_reduce_is_named_and_the_snapshot_holds_the_step(pool):
    code = ("def report_loss(loss, step):\n    if rank == 0 and step % 5 == 4:\n"
            "        dist.all_reduce(loss)\n"
            "for step in range(10):\n    report_loss(torch.tensor(1.0), step)\n")
    with pytest.raises(dh.CollectiveMismatch) as e:
        pool.run(code)
    assert "rank 1 finished the cell without calling it" in str(e.value)
    assert "step = 4" in e.value.where.text(0)


def test_bincount_of_the_shards_differs_in_shape(pool):
    with pytest.raises(dh.CollectiveMismatch) as e:
        pool.run(IMPORT + "dist.all_reduce(torch.bincount(lesson.labels(rank, world_size)))")
    f = e.value.finding
    assert f.kind == "shapes"
    assert {f.call.text(), f.other_call.text()} == {"all_reduce #1 int64[10]",
                                                    "all_reduce #1 int64[9]"}


def test_the_extra_batch_is_on_rank_0_and_meets_the_barrier(pool):
    code = IMPORT + ("x, y = lesson.shard(*lesson.regression_data(9), rank, world_size)\n"
                     "model = lesson.make_model()\n"
                     "for xb, yb in lesson.batches(x, y, 2):\n"
                     "    nn.functional.mse_loss(model(xb), yb).backward()\n"
                     "    lesson.average_gradients(model)\n"
                     "dist.barrier()\n")
    with pytest.raises(dh.CollectiveMismatch) as e:
        pool.run(code)
    assert "rank 0 is in all_reduce #3" in str(e.value) and "rank 1 is in barrier #3" in str(
        e.value)


def test_the_summed_update_is_twice_the_reference():
    reference = lesson.one_process_update(24)
    assert reference.abs().min() > 0
    results = dh.launch(_summed_update_probe, args=(2,), nprocs=2, timeout=60, output="none")
    for update in results:
        assert dh.compare("summed", update, 2 * reference)


def _summed_update_probe(rank, world_size):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    with dh.process_group(rank, world_size, verbose=False):
        x, y = lesson.shard(*lesson.regression_data(24), rank, world_size)
        model = lesson.make_model()
        before = model.weight.detach().clone()
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        torch.optim.SGD(model.parameters(), lr=lesson.LR).step()
        return (model.weight - before).detach()


def test_the_nan_is_in_rank_1s_batch_only_and_every_rank_raises(pool):
    code = IMPORT + (
        "x, y = lesson.shard(*lesson.regression_data(24, bad=lesson.BAD_SAMPLE), rank, "
        "world_size)\nmodel = lesson.make_model()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step, (xb, yb) in enumerate(lesson.batches(x, y, 2)):\n"
        "    opt.zero_grad()\n    loss = nn.functional.mse_loss(model(xb), yb)\n"
        "    loss.backward()\n    lesson.average_gradients(model)\n    opt.step()\n"
        "    if not torch.isfinite(model.weight).all():\n"
        "        raise FloatingPointError(step)\n")
    with pytest.raises(dh.RankRaised):
        pool.run(code)
    assert pool.run("step") == [3, 3]
    assert pool.run("bool(xb.isnan().any())") == [False, True]
    assert pool.run("bool(xb[0].isnan().any())") == [False, True]


def test_compare_finds_the_weights_of_rank_seeds_and_the_drifting_buffers(pool):
    pool.run(IMPORT + "torch.manual_seed(rank)\nmodel = nn.Linear(4, 1)\nx = torch.randn(8, 4)")
    assert pool.compare("model", "x").differs == ["model.weight", "model.bias", "x"]
    pool.run(IMPORT + "model = lesson.bn_model()\n"
             "x, y = lesson.shard(*lesson.regression_data(16), rank, world_size)\n"
             "for xb, yb in lesson.batches(x, y, 4):\n"
             "    nn.functional.mse_loss(model(xb), yb).backward()\n"
             "    lesson.average_gradients(model)\n")
    assert pool.compare("model").differs == ["model.1.running_mean", "model.1.running_var"]


def test_without_set_epoch_every_epoch_has_one_order(pool):
    orders = pool.run("from torch.utils.data import DistributedSampler\n"
                      "s = DistributedSampler(range(8), shuffle=True, seed=0)\n"
                      "[list(s) for _ in range(3)]")
    assert all(o[0] == o[1] == o[2] for o in orders)
    assert sorted(orders[0][0] + orders[1][0]) == list(range(8))


def test_the_answer_reader_takes_numbers_written_as_words():
    assert [lesson.integer(a) for a in (4, 4.0, "step 4", "rank 1", "4 or 5", True)] == [
        4, 4, 4, 1, None, None]
