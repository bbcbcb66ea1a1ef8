"""The panels' callback logic without a browser: a control change reruns and redraws."""

from functools import partial

import pytest

from ddp_helpers import data, widgets
from ddp_helpers.lessons import grad_sync as gs

SMALL = widgets.Settings(world_size=2, lr=0.05, batch_size=32, sync=True, steps=10)


@pytest.fixture(scope="module")
def source():
    return data.prepare_data(verbose=False)


def small_panel(source, **kw):
    experiment = partial(widgets.sync_experiment, source=source, train_subset=1_000)
    return widgets.TrainingPanel(experiment, defaults=SMALL, **kw)


def image_of(panel) -> str:
    (text, image) = panel.output.outputs
    assert text["output_type"] == "stream" and image["output_type"] == "display_data"
    return image["data"]["image/png"]


def test_progress_lines_split_any_chunks():
    calls = []
    stream = widgets.ProgressLines(lambda *a: calls.append(a))
    for chunk in ("[rank 1] progr", "ess 3/10\n[rank 0] process group: gloo\n[rank 0] ",
                  "progress 10/10\n", "[rank 0] progress 1/"):
        stream.write(chunk)
    assert calls == [(1, 3, 10), (0, 10, 10)]
    assert stream.other == ["[rank 0] process group: gloo"]


def test_launch_with_progress_reports_every_rank(source, no_leftovers):
    calls = []
    cfg = gs.SyncConfig(source=source, steps=6, train_subset=1_000, progress_every=2,
                        verbose=True)
    results, other = widgets.launch_with_progress(
        gs.train_with_sync, (2, cfg), 2, lambda *a: calls.append(a))
    assert len(results) == 2
    assert sorted(c for c in calls if c[0] == 1) == [(1, 2, 6), (1, 4, 6), (1, 6, 6)]
    assert (0, 6, 6) in calls
    assert any("process group:" in line for line in other)


def test_panel_runs_its_default_and_draws(source, no_leftovers):
    panel = small_panel(source)
    assert panel.runs == 1 and panel.error is None
    assert panel.settings() == SMALL
    assert [b.description for b in panel.bars.children] == ["rank 0", "rank 1"]
    assert [b.value for b in panel.bars.children] == [10, 10]
    assert "parameter distance between the ranks: 0 " in panel.summary[-1]
    assert image_of(panel)
    assert "dh-panel" in panel.widget._dom_classes
    assert "dh-panel-output" in panel.output._dom_classes
    assert "dh-panel-world-size" in panel.controls["world size"]._dom_classes
    assert panel.status.value.startswith("run 1: 2 rank(s)")
    assert not any(c.disabled for c in panel.controls.values())  # enabled again after the run


def test_slider_change_reruns_and_redraws(source, no_leftovers):
    panel = small_panel(source)
    before = image_of(panel)
    panel.controls["world size"].value = 1  # what dragging the slider in the browser does
    assert panel.runs == 2
    assert len(panel.results) == 1 and len(panel.bars.children) == 1
    assert image_of(panel) != before
    panel.controls["world size"].value = 2
    panel.controls["sync"].value = False
    assert panel.runs == 4
    assert panel.results[0]["sync"] == "none"
    assert gs.param_distance(panel.results)[-1].item() > 0


def test_panel_shows_an_impossible_setting_instead_of_raising(source, no_leftovers):
    panel = small_panel(source)
    panel.controls["batch size"].value = 256
    panel.controls["world size"].value = 4  # 1,000 images over 4 ranks: 250 per rank < 256
    assert panel.runs == 2  # the batch-size change ran; the world-size change was refused
    assert "less than one batch of 256" in panel.error
    (message,) = panel.output.outputs
    assert message["name"] == "stderr" and "The run failed" in message["text"]
    assert panel.status.value.startswith("failed")
    assert not any(c.disabled for c in panel.controls.values())


def test_panel_without_running_has_nothing_drawn():
    panel = widgets.sync_panel(run_now=False)
    assert panel.runs == 0 and panel.output.outputs == () and panel.results is None
    assert list(panel.controls) == ["world size", "learning rate", "batch size", "sync", "steps"]
