"""ipywidgets panels for lessons 05 and 06 (imported only by notebooks and their tests).

A panel has five controls (world size, learning rate, batch size, sync, steps). Changing one
reruns the experiment through `dh.launch`, with a progress bar per rank, and redraws the figure.
The ranks print "progress s/n" lines; the launcher relays them into this process's stdout while
the ranks run, where `ProgressLines` turns them into progress-bar updates. Everything the
callback does is plain Python on the panel object, so tests drive it without a browser.

DOM classes for browser tests: the panel is `.dh-panel`, the area it draws into
`.dh-panel-output`, the bars `.dh-panel-progress`, the status line `.dh-panel-status` (it
reads "run N: ..." after the N-th run), each control `.dh-panel-<description with dashes>`
(`.dh-panel-world-size`, `.dh-panel-learning-rate`, `.dh-panel-batch-size`, `.dh-panel-sync`,
`.dh-panel-steps`).
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from functools import partial

import ipywidgets as W
import matplotlib.pyplot as plt
from matplotlib.colors import to_hex

import ddp_helpers as dh
from ddp_helpers import data
from ddp_helpers.lessons import grad_sync
from ddp_helpers.plots import grad_sync as plots
from ddp_helpers.plots.common import rank_color

_PROGRESS = re.compile(r"^\[rank (\d+)\] progress (\d+)/(\d+)\s*$")
_BATCH_SIZES = (16, 32, 64, 128, 256)
ProgressCallback = Callable[[int, int, int], None]


@dataclass(frozen=True)
class Settings:
    """What the panel's controls say: one experiment's knobs."""

    world_size: int = 2
    lr: float = 0.01
    batch_size: int = 64
    sync: bool = True
    steps: int = 100


class ProgressLines(io.TextIOBase):
    """A text stream: "[rank r] progress s/n" lines call on_progress(r, s, n); others are kept."""

    def __init__(self, on_progress: ProgressCallback):
        self.on_progress = on_progress
        self.other: list[str] = []
        self._partial = ""

    def writable(self) -> bool:
        """Yes: it is written to."""
        return True

    def write(self, text: str) -> int:
        """Take text in any chunks; act on every complete line."""
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered beyond an unfinished line."""

    def _line(self, line: str) -> None:
        m = _PROGRESS.match(line)
        if m:
            self.on_progress(int(m[1]), int(m[2]), int(m[3]))
        elif line.strip():
            self.other.append(line)


def launch_with_progress(fn, args: tuple, nprocs: int, on_progress: ProgressCallback,
                         timeout: float = 300) -> tuple[list, list[str]]:
    """dh.launch with the ranks' progress lines fed to on_progress; (results, other lines)."""
    stream = ProgressLines(on_progress)
    # The launcher relays each line from the launching thread as it arrives, so while the
    # ranks run, their lines reach this stream (and the bars move) one by one.
    with redirect_stdout(stream), redirect_stderr(stream):
        results = dh.launch(fn, args=args, nprocs=nprocs, timeout=timeout, output="live")
    return results, stream.other


def sync_experiment(settings: Settings, on_progress: ProgressCallback,
                    source: data.DataSource | None = None, train_subset: int = 12_000
                    ) -> list[dict]:
    """Lesson 06's run (grad_sync.train_with_sync) with the panel's settings."""
    cfg = grad_sync.SyncConfig(
        source=source, sync="ddp" if settings.sync else "none", steps=settings.steps,
        batch_size=settings.batch_size, lr=settings.lr, train_subset=train_subset,
        progress_every=max(1, settings.steps // 25))
    grad_sync.check_config(cfg, settings.world_size)  # refuse here, before any rank starts
    results, _ = launch_with_progress(grad_sync.train_with_sync, (settings.world_size, cfg),
                                      settings.world_size, on_progress)
    return results


class TrainingPanel:
    """Controls, a progress bar per rank, and a figure that is redrawn after every rerun."""

    def __init__(self, experiment: Callable[[Settings, ProgressCallback], list],
                 draw: Callable[[list], object] = plots.loss_and_distance_plot,
                 summarize: Callable[[list], list[str]] = grad_sync.run_summary,
                 defaults: Settings = Settings(), max_world_size: int = 4,
                 run_now: bool = True):
        self.experiment, self.draw, self.summarize = experiment, draw, summarize
        self.results: list | None = None
        self.figure = None
        self.summary: list[str] = []
        self.error: str | None = None
        self.runs = 0
        self.controls = _controls(defaults, max_world_size)
        self.bars = W.VBox([]).add_class("dh-panel-progress")
        self.status = W.HTML("").add_class("dh-panel-status")
        self.output = W.Output().add_class("dh-panel-output")
        grid = W.GridBox(list(self.controls.values()),
                         layout=W.Layout(grid_template_columns="repeat(3, 330px)"))
        self.widget = W.VBox([grid, self.bars, self.status, self.output]).add_class("dh-panel")
        for control in self.controls.values():
            control.observe(self._on_change, names="value")
        if run_now:
            self.rerun()

    def settings(self) -> Settings:
        """The settings the controls show now."""
        c = self.controls
        return Settings(world_size=c["world size"].value, lr=c["learning rate"].value,
                        batch_size=c["batch size"].value, sync=c["sync"].value,
                        steps=c["steps"].value)

    def rerun(self) -> None:
        """Run the experiment with the controls' settings and redraw; show errors in the panel."""
        settings = self.settings()
        self._make_bars(settings)
        self._busy(True, f"running on {settings.world_size} rank(s)...")
        try:
            results = self.experiment(settings, self._progress)
        except (dh.LaunchError, ValueError) as e:
            self.error = str(e)
            self.output.outputs = (_stream(f"The run failed: {e}\n", "stderr"),)
            self._busy(False, "failed: see below; change a setting to try again")
            return
        self._busy(False, f"run {self.runs + 1}: {_describe(settings)}")
        self.error = None
        self.results = results
        self.summary = self.summarize(results)
        self.figure = self.draw(results)
        plt.close(self.figure)  # drawn into the output area only, not again by the cell
        self.output.outputs = (_stream("\n".join(self.summary) + "\n"), _image(self.figure))
        self.runs += 1

    def _on_change(self, change) -> None:
        self.rerun()

    def _progress(self, rank: int, step: int, total: int) -> None:
        if rank < len(self.bars.children):
            bar = self.bars.children[rank]
            bar.max, bar.value = total, step

    def _make_bars(self, settings: Settings) -> None:
        self.bars.children = [
            W.IntProgress(value=0, min=0, max=settings.steps, description=f"rank {r}",
                          style={"bar_color": to_hex(rank_color(r))})
            for r in range(settings.world_size)]

    def _busy(self, busy: bool, message: str) -> None:
        for control in self.controls.values():
            control.disabled = busy  # changes made during a run would queue up reruns
        self.status.value = message

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def sync_panel(source: data.DataSource | None = None, defaults: Settings = Settings(),
               train_subset: int = 12_000, run_now: bool = True) -> TrainingPanel:
    """The panel of lessons 05 and 06: train with or without gradient sync, redraw on change."""
    experiment = partial(sync_experiment, source=source, train_subset=train_subset)
    return TrainingPanel(experiment, defaults=defaults, run_now=run_now)


def _controls(d: Settings, max_world_size: int) -> dict[str, W.Widget]:
    style = {"description_width": "100px"}
    layout = W.Layout(width="320px")
    common = {"continuous_update": False, "style": style, "layout": layout}
    controls = [
        W.IntSlider(value=d.world_size, min=1, max=max_world_size, description="world size",
                    **common),
        W.FloatLogSlider(value=d.lr, base=10, min=-3, max=0, step=0.1, readout_format=".3g",
                         description="learning rate", **common),
        W.SelectionSlider(options=sorted({*_BATCH_SIZES, d.batch_size}), value=d.batch_size,
                          description="batch size", **common),
        W.Checkbox(value=d.sync, description="sync", indent=True, style=style, layout=layout),
        W.IntSlider(value=d.steps, min=10, max=400, step=10, description="steps", **common),
    ]
    for c in controls:  # e.g. .dh-panel-world-size, for browser tests to find each control
        c.add_class("dh-panel-" + c.description.replace(" ", "-"))
    return {c.description: c for c in controls}


def _describe(s: Settings) -> str:
    return (f"{s.world_size} rank(s), lr {s.lr:.3g}, batch {s.batch_size} per rank, "
            f"sync {'on' if s.sync else 'off'}, {s.steps} steps")


def _stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def _image(fig) -> dict:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": png, "text/plain": repr(fig)}}


__all__ = ["ProgressLines", "Settings", "TrainingPanel", "launch_with_progress",
           "sync_experiment", "sync_panel"]
