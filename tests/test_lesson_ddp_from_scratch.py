"""Lesson 09: the four hand-written DDPs against torch's, and the checks that grade them, on two
real gloo ranks. Every exercise: the kit's solution PASSES, the template is NOT ATTEMPTED, and
functions that return None FAIL (tests/test_exercise_ddp_from_scratch.py tries the plausible
wrong answers, and correct ones written differently, on 3 ranks)."""

import pytest
import torch

import ddp_helpers as dh
from ddp_helpers import exercises
from ddp_helpers.lessons import ddp_from_scratch as lesson

EXERCISES = ("naive_ddp", "flat_ddp", "overlapped_ddp", "bucketed_ddp")


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(2, timeout=60, output="none") as p:
        p.run("from ddp_helpers.lessons import ddp_from_scratch as lesson")
        yield p


def verdict(pool, name: str, source: str) -> str:
    """Define `source` on the ranks (as a learner's %%ranks cell would), then check `name`."""
    pool.run(source)
    return exercises.evaluate(name, pool=pool).line


def template(name: str) -> str:
    """What the notebook commits: each function of the exercise with `...` as its body."""
    return "\n".join(f"def {fn}(*args):\n    ...\n" for fn in lesson.FUNCTIONS[name])


def returns_none(name: str) -> str:
    """Every function of the exercise replaced by one that does nothing and returns None."""
    return "\n".join(f"def {fn}(*args):\n    return None\n" for fn in lesson.FUNCTIONS[name])


@pytest.mark.parametrize("name", EXERCISES)
def test_the_kits_solution_passes(pool, name):
    assert verdict(pool, name, exercises.solution_source(name)).startswith(f"PASS {name}")


@pytest.mark.parametrize("name", EXERCISES)
def test_the_template_is_not_attempted(pool, name):
    assert verdict(pool, name, template(name)).startswith(f"NOT ATTEMPTED {name}")


@pytest.mark.parametrize("name", EXERCISES)
def test_functions_returning_none_fail(pool, name):
    assert verdict(pool, name, returns_none(name)).startswith(f"FAIL {name}")


# ---------------------------------------------------------------- the numbers the notebook shows


def test_the_model_has_a_tied_and_a_frozen_parameter():
    model = lesson.tied_model(0, **lesson.SMALL)
    params = list(model.parameters())
    walked = [p for m in model.modules() for p in m.parameters(recurse=False)]
    assert (len(params), sum(p.requires_grad for p in params), len(walked)) == (7, 6, 8)
    assert model.head.weight is model.embed.weight


@pytest.mark.parametrize("name, counts", [
    ("naive", [{"all_reduce": 6}] * 3), ("flat", [{"all_reduce": 1}] * 3),
    ("overlapped", [{"all_reduce": 6}] * 3), ("bucketed", [{"all_reduce": 2}] * 3)])
def test_each_version_equals_ddp_and_one_process_with_its_count(pool, name, counts):
    records = pool.run(f"lesson.run_version({name!r}, None, rank, world_size, device)")
    for rec in records:
        assert rec["source"] == "the kit's solution"
        assert rec["equals_ddp"] and rec["equals_single"]
        assert rec["collectives"] == counts
        # every version sends the six gradients' bytes once per step, however it groups them
        assert rec["bytes"] == [lesson.gradient_bytes(lesson.tied_model(0).parameters())] * 3
    assert torch.equal(records[0]["params"], records[1]["params"])
    # DDP puts every gradient in one bucket for the first step, then rebuilds its buckets in
    # the order gradients arrived (two broadcasts agree on them) and uses them from then on.
    assert records[0]["ddp_collectives"] == [
        {"all_reduce": 1}, {"all_reduce": 2, "broadcast": 2}, {"all_reduce": 2}]


def test_gradients_arrive_last_layer_first_and_the_tied_weight_once(pool):
    order = pool.run("lesson.gradient_order(device)", targets=[0])[0]
    assert order == ["body.1.0.bias", "body.1.0.weight", "body.0.0.bias", "body.0.0.weight",
                     "frozen.bias", "embed.weight"]


def test_bucket_counts_of_the_sweep():
    model = lesson.tied_model(0, **lesson.LARGE)
    make = exercises.solution_module("bucketed_ddp").make_buckets
    assert [len(make(model, cap)) for cap in lesson.SWEEP_CAPS_MB] == lesson.SWEEP_BUCKETS
    assert lesson.gradient_bytes(model.parameters()) == 2_628_608


def test_timed_versions_issue_the_collectives_the_notebook_prints(pool):
    times = pool.run("lesson.time_versions(None, rank, world_size, device, rounds=1)")
    for per_rank in times:
        assert list(per_rank) == ["none", "naive", "flat", "overlapped", "bucketed", "ddp"]
        assert all(t["seconds"] > 0 and len(t["rounds"]) == 1 for t in per_rank.values())
        assert {n: t["collectives"] for n, t in per_rank.items()} == {
            "none": {}, "naive": {"all_reduce": 14}, "flat": {"all_reduce": 1},
            "overlapped": {"all_reduce": 14}, "bucketed": {"all_reduce": 4},
            "ddp": {"all_reduce": 4}}
        grads = lesson.gradient_bytes(lesson.tied_model(0, **lesson.LARGE).parameters())
        assert {n: t["bytes"] for n, t in per_rank.items()} == {
            "none": 0, **{n: grads for n in lesson.TIMED[1:]}}


def test_alpha_beta_fit_recovers_a_known_line():
    sizes = [4**k for k in range(1, 10)]
    seconds = [2e-4 + n / 1e9 for n in sizes]
    alpha, bandwidth = lesson.fit_alpha_beta(sizes, seconds)
    assert alpha == pytest.approx(2e-4, rel=1e-3) and bandwidth == pytest.approx(1e9, rel=1e-3)
    assert lesson.best_bucket_bytes(2e-4, 1e9, 4e6) == pytest.approx((2e-4 * 1e9 * 4e6) ** 0.5)


def _timed(naive: list[float], flat: list[float]) -> dict:
    return {"naive": {"seconds": sorted(naive)[len(naive) // 2], "rounds": naive},
            "flat": {"seconds": sorted(flat)[len(flat) // 2], "rounds": flat}}


def test_naive_against_flat_is_counted_round_by_round_on_every_rank():
    times = [_timed([3, 3, 1, 3], [2, 2, 2, 2]), _timed([3, 1, 1, 3], [2, 2, 2, 2])]
    assert lesson.slower_rounds(times, "naive", "flat") == [3, 2]
    assert lesson.describe_naive_against_flat(times).endswith("on every rank: NO")  # 2 of 4
    times[1] = _timed([3, 3, 3, 1], [2, 2, 2, 2])
    assert lesson.describe_naive_against_flat(times) == (
        "naive's step longer than flat's in most of the 4 rounds, on every rank: yes")


def test_times_table_prints_each_median_with_its_fastest_and_slowest_round():
    table = lesson.describe_times([_timed([0.003, 0.001, 0.002], [0.002] * 3)])
    assert table.splitlines()[1].split() == ["naive", "2.0", "(1.0-3.0)"]
