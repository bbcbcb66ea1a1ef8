"""The panels' callback logic without a browser: a control change reruns and redraws."""

import pytest
from mnist_shared import offline_source

from ddp_helpers import widgets
from ddp_helpers.lessons import gradient_sync_effects as gs

SMALL = widgets.Settings(world_size=2, lr=0.05, batch_size=32, sync="ddp", steps=10)
LOADER = widgets.LoaderSettings(world_size=2, num_workers=0, batch_size=64, sampler=True,
                                loader="in memory")


@pytest.fixture(scope="module")
def source():
    return offline_source()


def small_panel(source, **kw):
    return widgets.sync_panel(source, defaults=SMALL, train_subset=1_000, **kw)


def image_of(panel) -> str:
    (text, image) = panel.output.outputs
    assert text["output_type"] == "stream" and image["output_type"] == "display_data"
    return image["data"]["image/png"]


def test_launch_with_progress_reports_every_rank_through_the_sink(source):
    calls = []
    cfg = gs.SyncConfig(source=source, steps=6, train_subset=1_000, progress_every=2,
                        verbose=True)
    results, other = widgets.launch_with_progress(
        gs.train_with_sync, (2, cfg), 2, lambda *a: calls.append(a),
        widgets._matcher(r"^progress (\d+)/(\d+)$"))
    assert len(results) == 2
    assert sorted(c for c in calls if c[0] == 1) == [(1, 2, 6), (1, 4, 6), (1, 6, 6)]
    assert (0, 6, 6) in calls
    assert any(line.startswith("[rank 0] process group:") for line in other)


def test_a_progress_reader_counts_from_zero_when_given_the_total():
    read = widgets._matcher(r"Batch (\d+)$", total=47)
    assert read("Process cpu, Batch 0") == (1, 47) and read("something else") is None


def test_sync_panel_runs_its_default_and_draws(source):
    panel = small_panel(source)
    assert panel.runs == 1 and panel.error is None
    assert panel.settings() == SMALL
    assert [b.description for b in panel.bars.children] == ["rank 0", "rank 1"]
    assert [b.value for b in panel.bars.children] == [10, 10]
    assert "parameter distance between the ranks: 0 " in panel.summary[-1]
    assert image_of(panel)
    assert "dh-panel" in panel.widget._dom_classes
    assert "dh-panel-output" in panel.output._dom_classes
    assert "dh-panel-world-size" in panel.controls["world_size"]._dom_classes
    assert panel.status.value.startswith("run 1: 2 rank(s)")
    assert panel.status.value.endswith("10 steps")  # the browser test reads the steps here
    assert not any(c.disabled for c in panel.controls.values())  # enabled again after the run


def test_sync_panel_control_changes_rerun_and_redraw(source):
    panel = small_panel(source)
    before = image_of(panel)
    panel.controls["world_size"].value = 1  # what dragging the slider in the browser does
    assert panel.runs == 2
    assert len(panel.results) == 1 and len(panel.bars.children) == 1
    assert image_of(panel) != before
    panel.controls["world_size"].value = 2
    panel.controls["sync"].value = "average"
    panel.controls["every"].value = 5
    assert panel.runs == 5
    assert panel.results[0]["sync"] == "average" and panel.results[0]["every"] == 5
    assert gs.param_distance(panel.results)[5].item() == 0  # averaged after step 5
    panel.controls["split"].value = "by_label"
    assert panel.results[0]["digits"] == [0, 1, 2, 3, 4]


def test_sync_panel_shows_an_impossible_setting_instead_of_raising(source):
    panel = small_panel(source)
    panel.controls["batch_size"].value = 256
    panel.controls["world_size"].value = 4  # 1,000 images over 4 ranks: 250 per rank < 256
    assert panel.runs == 2  # the batch-size change ran; the world-size change was refused
    assert "less than one batch of 256" in panel.error
    (message,) = panel.output.outputs
    assert message["name"] == "stderr" and "The run failed" in message["text"]
    assert panel.status.value.startswith("failed")
    assert not any(c.disabled for c in panel.controls.values())


def test_panels_without_running_have_nothing_drawn_and_name_their_controls():
    sync = widgets.sync_panel(run_now=False)
    assert sync.runs == 0 and sync.output.outputs == () and sync.results is None
    assert [c.description for c in sync.controls.values()] == [
        "world size", "learning rate", "batch size", "sync", "every k", "split", "steps"]
    loader = widgets.loader_panel(run_now=False)
    assert [c.description for c in loader.controls.values()] == [
        "world size", "workers", "batch size", "sampler", "data path"]


def test_loader_panel_shows_samples_per_rank_with_and_without_the_sampler(source):
    panel = widgets.loader_panel(source, defaults=LOADER)
    assert [r["samples_seen"] for r in panel.results] == [1500, 1500]
    assert panel.summary[0].startswith("rank 0: 1,500 of 3,000 images in 24 steps, epoch ")
    assert [b.value for b in panel.bars.children] == [24, 24]
    panel.controls["sampler"].value = False
    assert [r["samples_seen"] for r in panel.results] == [3000, 3000]
    panel.controls["loader"].value = "DataLoader"  # the listing as printed: sampler off
    assert [r["samples_seen"] for r in panel.results] == [3000, 3000]
    assert [b.value for b in panel.bars.children] == [47, 47]  # from its per-batch lines
    assert panel.status.value.startswith("run 3: 2 rank(s), batch 64 per rank, sampler off, "
                                         "DataLoader, 0 worker(s) per rank")
