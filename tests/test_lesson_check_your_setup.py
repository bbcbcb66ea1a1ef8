"""Lesson 00: the machine report, the kit's choice, the two-rank all-reduce and the summary."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import ddp_helpers as dh
from ddp_helpers.lessons import check_your_setup as setup_check
from ddp_helpers.plots import check_your_setup as plots


@pytest.fixture(scope="module")
def report():
    return setup_check.collect_report(nprocs=2)


def test_report_has_every_section(report):
    assert set(report) == {"versions", "cpu", "gpus", "backends", "distributed", "choice"}
    assert report["versions"]["torch"] == torch.__version__
    assert report["backends"]["gloo"] is True  # every lesson depends on it
    assert report["cpu"]["logical cores"] >= 1
    assert len(report["gpus"]) == dh.gpu_count()


def test_choice_matches_choose_backend(report):
    backend, device, why = dh.choose_backend("auto", 2)
    assert report["choice"] == {"nprocs": 2, "backend": backend, "device": device, "why": why}


@pytest.mark.skipif(dh.gpu_count() > 0, reason="checks the CPU-only answer")
def test_choice_without_gpus_is_gloo_on_cpu(report):
    assert (report["choice"]["backend"], report["choice"]["device"]) == ("gloo", "cpu")


def test_print_section_aligns_names(report, capsys):
    setup_check.print_section(report, "backends")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["gloo", "available"]
    assert [line.split()[0] for line in lines] == ["gloo", "nccl", "mpi"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_leaves_the_sum_on_every_rank(world_size):
    results = dh.launch(setup_check.two_rank_all_reduce, args=(world_size,), nprocs=world_size,
                        output="none")
    want = setup_check.expected_sum(world_size)
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["result"].tolist() == [want] * 3


def test_summary_and_verdict_pass_after_a_good_run(report):
    results = dh.launch(setup_check.two_rank_all_reduce, args=(2,), nprocs=2, output="none")
    text = setup_check.summary(report, results)
    assert text.startswith("--- ddp_helpers setup check ---")
    assert f"torch: {torch.__version__}" in text
    assert "PASS  two-rank all_reduce  (every rank holds 3)" in text
    assert setup_check.verdict(report, results).startswith("all 6 checks passed")


def test_verdict_names_the_failed_check(report):
    backend, device = report["choice"]["backend"], report["choice"]["device"]
    wrong = [{"rank": r, "backend": backend, "device": device,
              "result": torch.tensor([2.0, 2.0, 2.0])} for r in range(2)]
    assert "FAIL  two-rank all_reduce  (expected 3, got" in setup_check.summary(report, wrong)
    assert setup_check.verdict(report, wrong).startswith("1 of 6 checks failed: two-rank")
    assert "not run yet" in setup_check.summary(report, None)


def test_version_parsing_ignores_local_suffixes():
    assert setup_check._version_tuple("2.14.1+cu130") == (2, 14)
    assert setup_check._version_tuple("2.5.0a0+git123") == (2, 5)
    assert setup_check._version_tuple("2.9.1", parts=3) >= setup_check.MIN_TORCH
    assert setup_check._version_tuple("2.9.0", parts=3) < setup_check.MIN_TORCH


def test_the_figure_has_a_bar_per_rank_before_and_after():
    results = dh.launch(setup_check.two_rank_all_reduce, args=(2,), nprocs=2, output="none")
    fig = plots.before_after_plot(results)
    before, after = fig.axes
    assert [p.get_height() for p in before.patches] == [1.0, 2.0]
    assert [p.get_height() for p in after.patches] == [3.0, 3.0]


def _good_results(report):
    choice = report["choice"]
    return [{"rank": r, "backend": choice["backend"], "device": choice["device"],
             "result": torch.tensor([3.0, 3.0, 3.0])} for r in range(2)]


def _spoil(report, results, what):
    """A copy of the report and results with the one thing `what` reads made wrong."""
    report = copy.deepcopy(report)
    results = copy.deepcopy(results)
    if what == "python":
        report["versions"]["python"] = "3.8.10"
    elif what == "torch":
        report["versions"]["torch"] = "2.1.0+cu121"
    elif what == "distributed":
        report["distributed"] = False
    elif what == "gloo":
        report["backends"]["gloo"] = False
    elif what == "choice":
        results[1]["backend"], results[1]["device"] = "mpi", "meta"
    elif what == "all_reduce":
        results[0]["result"] = torch.tensor([1.0, 1.0, 1.0])
    return report, results


@pytest.mark.parametrize("what, index", [("python", 0), ("torch", 1), ("distributed", 2),
                                         ("gloo", 3), ("choice", 4), ("all_reduce", 5)])
def test_each_check_can_fail_alone(report, what, index):
    if "torch" not in setup_check._FLOORS:
        pytest.skip("the kit is not installed: its torch floor is unknown, so that check fails")
    results = _good_results(report)
    assert all(ok for _, ok, _ in setup_check.checks(report, results))
    spoiled = setup_check.checks(*_spoil(report, results, what))
    failed = [i for i, (_, ok, _) in enumerate(spoiled) if not ok]
    assert failed == [index], spoiled
    assert setup_check.verdict(*_spoil(report, results, what)).startswith("1 of 6 checks failed")


def test_without_the_kit_installed_both_floor_checks_fail_and_say_why(report, monkeypatch):
    # No metadata, no floor: a check against an unknown floor must not PASS ("Python ? or newer").
    monkeypatch.setattr(setup_check, "_FLOORS", {})
    results = _good_results(report)
    checks = setup_check.checks(report, results)
    for (what, ok, detail), name in zip(checks[:2], ("Python", "torch")):
        assert (what, ok) == (f"{name} at the kit's floor", False)
        assert "pip install -e ." in detail
    assert all(ok for _, ok, _ in checks[2:])


def test_the_choice_check_names_what_the_ranks_used(report):
    results = _good_results(report)
    results[1]["backend"] = "mpi"
    what, ok, detail = setup_check.checks(report, results)[4]
    assert (what, ok) == ("ranks used the kit's backend choice", False)
    assert "the ranks used" in detail and "mpi on" in detail
    assert setup_check.checks(report, None)[4][1] is False


def test_one_core_is_a_note_not_a_failure(report):
    # With one core the ranks take turns: slower, still correct, so the verdict must pass.
    one = copy.deepcopy(report)
    one["cpu"]["usable by this process"] = 1
    results = _good_results(one)
    assert "NOTE  1 usable CPU core: the ranks take turns" in setup_check.summary(one, results)
    if "torch" in setup_check._FLOORS:
        assert setup_check.verdict(one, results).startswith("all 6 checks passed")
    one["cpu"]["usable by this process"] = 4
    assert setup_check.cores_note(one) == "4 usable CPU cores: two ranks run side by side"


def _fake_smi(tmp_path, monkeypatch, rows):
    """An nvidia-smi on PATH that prints `rows`, and torch seeing len(rows) GPUs."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo '{row}'\n" for row in rows))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(setup_check, "gpu_count", lambda: len(rows))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def test_gpu_names_come_from_nvidia_smi_or_say_why_not(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, ["NVIDIA H100, 81559 MiB"] * 2)
    assert [setup_check.gpu_text(g) for g in setup_check.gpu_info()] == [
        "NVIDIA H100 (81559 MiB)"] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert [setup_check.gpu_text(g) for g in setup_check.gpu_info()] == [
        "name not shown (CUDA_VISIBLE_DEVICES=0,1 is set; run nvidia-smi -L)"] * 2


def test_mixed_gpu_models_are_named_only_in_pci_bus_order(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, ["NVIDIA A100, 40960 MiB", "NVIDIA H100, 81559 MiB"])
    assert all("CUDA_DEVICE_ORDER=PCI_BUS_ID" in setup_check.gpu_text(g)
               for g in setup_check.gpu_info())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert [g["name"] for g in setup_check.gpu_info()] == ["NVIDIA A100", "NVIDIA H100"]
