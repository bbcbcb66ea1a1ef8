"""The lessons as a learner sees them: JupyterLab in headless Chromium, Run All, then look.

nbval runs the notebooks in a bare kernel; it cannot see whether the ranks' relayed lines reach
the cell, whether plots render, or whether an ipywidgets panel draws and reacts. This drives a
real JupyterLab (on a temporary copy of the notebooks) with Playwright and Debian's Chromium.
Screenshots land in tests/browser-artifacts/ (kept, gitignored) for a failing run to be read.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass

import psutil
import pytest
from browser_support import (
    ARTIFACTS,
    CHROMIUM,
    REPO,
    LabNotebook,
    copy_notebooks,
    launch_browser,
    start_lab,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason=f"{CHROMIUM} is absent: install Debian's chromium (.ci/run does)"),
]

RUN_TIMEOUT = 600  # seconds for Run All; a notebook takes about a minute on two idle cores


@dataclass(frozen=True)
class Expect:
    """What a learner must see after Run All."""

    ranks: tuple[int, ...]  # ranks whose "[rank r] ..." lines a launching cell shows
    min_images: int  # rendered plot images in output areas
    marker: str = "dh.launch("  # what a launching cell's source contains


SETUP = "00_check_your_setup.ipynb"
SYNC = "06_gradient_sync_effects.ipynb"
# Written in %%ranks cells: the learner types the code, every rank prints, plots come from
# --return.
RANKS = "03_ddp_wrapping.ipynb"
SCRATCH = "09_ddp_from_scratch.ipynb"
AFTER_DDP = "10_sharding_and_compression.ipynb"
SPLIT = "11_tensor_and_pipeline_parallel.ipynb"
# 00's and 06's launching cells relay one line, from rank 0: dh.process_group says there which
# backend it chose (the other ranks stay quiet).
EXPECT = {SETUP: Expect(ranks=(0,), min_images=0),
          SYNC: Expect(ranks=(0,), min_images=1),
          RANKS: Expect(ranks=(0, 1), min_images=1, marker="%%ranks"),
          SCRATCH: Expect(ranks=(0, 1), min_images=3, marker="%%ranks"),
          AFTER_DDP: Expect(ranks=(0, 1), min_images=3, marker="%%ranks"),
          SPLIT: Expect(ranks=(0, 1), min_images=2, marker="%%ranks")}
PANEL_SLIDER = "steps"  # the panel's slider the test moves


def _present(name: str) -> bool:
    return (REPO / "notebooks" / name).is_file()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a free port, serving a temporary copy of the notebooks under test."""
    state = tmp_path_factory.mktemp("lab")
    root = state / "root"
    root.mkdir()
    copy_notebooks([n for n in EXPECT if _present(n)], root)
    ARTIFACTS.mkdir(exist_ok=True)
    for old in ARTIFACTS.glob("*"):  # last run's screenshots would mislead
        if old.is_file():
            old.unlink()
    server = start_lab(root, state)
    try:
        yield server
    finally:
        survivors = server.stop()
        shutil.copy(server.log_path, ARTIFACTS / "jupyterlab-server.log")
        assert not survivors, f"processes outlived the JupyterLab server: {survivors}"


@pytest.fixture(scope="module")
def browser(lab, tmp_path_factory):
    """Headless Chromium with a fresh profile; closed, with its driver, after the module."""
    from playwright.sync_api import sync_playwright

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with sync_playwright() as pw:
        context = launch_browser(pw, tmp_path_factory.mktemp("chromium-profile"))
        try:
            yield context
        finally:
            context.close()
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.name())
                p.kill()
        except psutil.Error:  # gone meanwhile
            pass
    assert not left, f"browser processes outlived the test: {left}"


@pytest.fixture
def notebook(request, lab, browser):
    """Open notebook `request.param` in a new tab; screenshot it at the end (pass or fail),
    then free its kernel."""
    name = request.param
    if not _present(name):
        pytest.skip(f"notebooks/{name} is not in the repository yet")
    page = browser.new_page()
    nb = LabNotebook(page, lab, name, ARTIFACTS)
    try:
        nb.open()
        yield nb
    finally:
        nb.screenshot("final")
        nb.save_console()
        try:
            nb.shut_down_kernel()
        finally:
            page.close()


def run_all_and_check(nb: LabNotebook, expect: Expect) -> None:
    """Run All through the menu, then assert what every lesson must show."""
    nb.run_all()
    nb.wait_until_run(RUN_TIMEOUT)
    nb.screenshot("after-run-all")
    errors = nb.error_outputs()
    assert not errors, f"{nb.name}: error output in cells not tagged raises-exception: {errors}"
    unrun = nb.unrun_code_cells()
    assert not unrun, f"{nb.name}: Run All stopped; code cells without a result: {unrun}"
    launching = nb.launching_cells_with_ranks(expect.ranks, expect.marker)
    assert launching, (f"{nb.name}: no cell with {expect.marker!r} shows relayed lines of "
                       f"ranks {list(expect.ranks)} ('[rank r] ...')")
    cell = nb.cell_nodes().nth(launching[0])
    assert cell.is_visible()
    nb.screenshot("launching-cell", cell)
    images = nb.rendered_images()
    assert len(images) >= expect.min_images, (
        f"{nb.name}: {len(images)} rendered plot images, expected at least {expect.min_images}")


@pytest.mark.parametrize("notebook", [SETUP], indirect=True)
def test_setup_notebook_runs_clean_in_jupyterlab(notebook):
    run_all_and_check(notebook, EXPECT[SETUP])


@pytest.mark.parametrize("notebook", [SYNC], indirect=True)
def test_gradient_sync_panel_reruns_and_redraws(notebook):
    run_all_and_check(notebook, EXPECT[SYNC])
    panel = notebook.widget_panel()
    panel.scroll_into_view_if_needed()
    assert "Loading widget" not in panel.inner_text()
    status = panel.locator(".dh-panel-status")
    before = notebook.panel_images()
    assert before and all(before), "the panel's output (class dh-panel-output) shows no plot"
    status_before = status.inner_text()
    notebook.screenshot("panel-before", panel)

    old, new = notebook.nudge_slider(PANEL_SLIDER)
    after = notebook.wait_for_redraw(before, RUN_TIMEOUT)
    notebook.screenshot("panel-after", panel)
    assert after != before, f"moving {PANEL_SLIDER!r} {old:g} -> {new:g} did not redraw the plot"
    status_after = status.inner_text()
    assert status_after != status_before and f"{new:g} steps" in status_after, (
        f"the panel's status line did not report the rerun with {new:g} steps: {status_after!r}")
    assert "failed" not in panel.inner_text(), panel.inner_text()
    errors = notebook.error_outputs()
    assert not errors, f"the rerun after moving {PANEL_SLIDER!r} showed errors: {errors}"


@pytest.mark.parametrize("notebook", [RANKS, SCRATCH, AFTER_DDP, SPLIT], indirect=True)
def test_ranks_lesson_shows_every_rank_and_plots_what_came_back(notebook):
    run_all_and_check(notebook, EXPECT[notebook.name])
    index, name = _first_plot_of_returned_data(notebook.cells)
    notebook.screenshot("plot-from-return", notebook.cell_nodes().nth(index))
    assert notebook.cell_images(index) >= 1, (
        f"{notebook.name}: cell {index} drew no image from the returned {name!r}")


def _first_plot_of_returned_data(cells) -> tuple[int, str]:
    """The first code cell that plots (plots.*) a variable an earlier `%%ranks --return` cell
    brought back, and that variable's name."""
    returned: set[str] = set()
    for i, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        if cell.source.startswith("%%ranks --return"):
            returned.update(cell.source.split()[2].split(","))
        elif "plots." in cell.source:
            used = sorted(n for n in returned if re.search(rf"\b{n}\b", cell.source))
            if used:
                return i, used[0]
    pytest.fail("no plots.* cell uses what a `%%ranks --return NAME` cell brought back")
