"""ddp_helpers.compat: each feature check agrees with what two real gloo ranks can do.

The checks answer without a peer (a private one-rank group, or torch's signatures); these tests
hold each answer against the feature itself on a real two-rank gloo group, on whichever torch
runs them, so `make test-min` checks the floor's answers and `make test` the newest.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddp_helpers as dh
from ddp_helpers import compat

# ---------------------------------------------------------------- what the ranks run


def _worked(fn) -> bool | str:
    """True if fn() ran; else the first line of what it raised (a TypeError for a missing kwarg)."""
    try:
        fn()
    except (RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return True


def gloo_truth(rank: int, world_size: int) -> dict:
    """Try each probed feature on a real group, and ask compat in this fresh process too."""
    with dh.process_group(rank, world_size, backend="gloo", verbose=False):
        avg = torch.tensor([float(rank + 1)])
        out = torch.empty(1)
        truth = {
            "avg": _worked(lambda: dist.all_reduce(avg, op=dist.ReduceOp.AVG)),
            "reduce_scatter": _worked(lambda: dist.reduce_scatter(
                out, [torch.tensor([1.0 + rank]), torch.tensor([10.0 + rank])])),
            "barrier_timeout": _worked(
                lambda: dist.barrier(timeout=datetime.timedelta(seconds=30))),
        }
        # compat's probe group is private: the default group must work as before after it
        answers = {"avg": compat.gloo_supports_avg(),
                   "reduce_scatter": compat.gloo_supports_reduce_scatter(),
                   "barrier_timeout": compat.barrier_accepts_timeout()}
        mean = torch.tensor([float(rank + 1), 10.0 * rank])
        compat.all_reduce_mean(mean)
        return {"truth": truth, "answers": answers, "mean": mean.tolist(),
                "avg_value": avg.item(), "rs_value": out.item(),
                "world_size": dist.get_world_size()}


def counted_all_reduces(rank: int, world_size: int) -> int | None:
    """How many collectives CommDebugMode counts around one all_reduce (None: no CommDebugMode)."""
    mode_class = compat.comm_debug_mode()
    if mode_class is None:
        return None
    with dh.process_group(rank, world_size, backend="gloo", verbose=False):
        mode = mode_class()
        with mode:
            dist.all_reduce(torch.ones(3))
        return mode.get_total_counts()


def barrier_with_a_late_rank(rank: int, world_size: int, flag: str) -> str:
    """Rank 0 waits in compat.barrier(2 s) for rank 1, which waits for rank 0 to give up first."""
    with dh.process_group(rank, world_size, backend="gloo", verbose=False):
        compat.barrier(timeout=datetime.timedelta(seconds=30))  # everyone: passes
        if rank == 1:
            while not Path(flag).exists():  # stays in the group, never at the barrier
                time.sleep(0.05)
            return "waited"
        try:
            compat.barrier(timeout=datetime.timedelta(seconds=2))
        except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
            return str(e).splitlines()[0]
        finally:
            Path(flag).touch()
        return "passed without rank 1"


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def gloo_results():
    return dh.launch(gloo_truth, args=(2,), nprocs=2, timeout=120, output="none")


def test_probes_agree_with_two_real_gloo_ranks(gloo_results, no_leftovers):
    for r in gloo_results:
        assert r["world_size"] == 2
        for feature, works in r["truth"].items():
            assert r["answers"][feature] is (works is True), (
                f"compat says {feature} is {r['answers'][feature]}, two ranks say {works}")


def test_supported_features_give_the_right_numbers(gloo_results):
    for rank, r in enumerate(gloo_results):
        if r["truth"]["avg"] is True:
            assert r["avg_value"] == 1.5  # (1 + 2) / 2
        if r["truth"]["reduce_scatter"] is True:
            assert r["rs_value"] == [1.0 + 2.0, 10.0 + 11.0][rank]  # rank r gets chunk r, summed


def test_unsupported_features_fail_the_way_compat_documents(gloo_results):
    for r in gloo_results:
        if r["truth"]["avg"] is not True:
            assert "AVG" in r["truth"]["avg"]
        if r["truth"]["reduce_scatter"] is not True:
            assert "reduce_scatter" in r["truth"]["reduce_scatter"]
        if r["truth"]["barrier_timeout"] is not True:
            assert r["truth"]["barrier_timeout"].startswith("TypeError")


def test_all_reduce_mean_averages_with_or_without_gloo_avg(gloo_results):
    # [rank + 1, 10 * rank] averaged over ranks 0 and 1: [1.5, 5.0], by AVG or by SUM / 2
    assert [r["mean"] for r in gloo_results] == [[1.5, 5.0], [1.5, 5.0]]


def test_parent_probe_leaves_no_default_group():
    compat.gloo_supports_avg()
    assert not dist.is_initialized()


def test_answers_are_cached():
    first = compat.gloo_supports_reduce_scatter()
    hits = compat.gloo_supports_reduce_scatter.cache_info().hits
    assert compat.gloo_supports_reduce_scatter() is first
    assert compat.gloo_supports_reduce_scatter.cache_info().hits == hits + 1


def test_init_device_id_probe_matches_the_signature():
    import inspect

    assert compat.init_accepts_device_id() is (
        "device_id" in inspect.signature(dist.init_process_group).parameters)


def test_fsdp2_fully_shard_is_the_function_or_none():
    fully_shard = compat.fsdp2_fully_shard()
    if fully_shard is not None:
        assert callable(fully_shard) and "fully_shard" in fully_shard.__name__
        assert fully_shard.__module__.startswith("torch.distributed")


def test_comm_debug_mode_counts_one_all_reduce(no_leftovers):
    counts = dh.launch(counted_all_reduces, args=(2,), nprocs=2, timeout=30, output="live")
    assert counts == ([None, None] if compat.comm_debug_mode() is None else [1, 1])


def test_post_accumulate_grad_hook_fires_when_present():
    if not compat.has_post_accumulate_grad_hook():
        assert not hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
        return
    p = torch.nn.Parameter(torch.ones(3))
    seen = []
    p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad.sum().item()))
    (p * 2).sum().backward()
    assert seen == [6.0]


def test_barrier_passes_together_and_gives_up_on_a_missing_rank(tmp_path, no_leftovers):
    rank0, rank1 = dh.launch(barrier_with_a_late_rank, args=(2, str(tmp_path / "flag")),
                             nprocs=2, timeout=120, output="none")
    assert rank1 == "waited"
    assert rank0 != "passed without rank 1"
    # dist.barrier(timeout=) says "timed out"; monitored_barrier names the rank that never came
    assert ("timed out" in rank0.lower()) or ("Rank 1 failed to pass" in rank0), rank0


def test_report_names_every_check():
    found = compat.report()
    assert set(found) == {"gloo all_reduce AVG", "gloo reduce_scatter", "barrier(timeout=...)",
                          "init_process_group(device_id=...)", "FSDP2 fully_shard",
                          "CommDebugMode", "post-accumulate-grad hooks"}
    assert all(isinstance(v, bool) for v in found.values())
