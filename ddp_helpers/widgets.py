"""ipywidgets panels for lessons 05 and 06 (imported only by notebooks and their tests).

A panel is a set of controls, a progress bar per rank, a status line and an output area.
Changing a control reruns its experiment through `dh.launch` and redraws the figure. The
launcher hands every line a rank prints to a sink in this process (`launch(output=sink)`),
which turns progress lines into bar updates. Everything the callbacks do is plain Python on the
panel object, so tests drive it without a browser.

- `loader_panel` (lesson 05): world size, DataLoader workers, batch size, sampler on/off, and
  DataLoader or in-memory data; it shows per rank the samples seen and the epoch time.
- `sync_panel` (lesson 06): world size, learning rate, batch size, sync (DDP every step, none,
  or parameter averaging every k steps), k, the data split (IID or by label), and steps; it shows
  per rank the loss and the distance between the ranks' parameters.

DOM classes for browser tests: the panel is `.dh-panel`, the area it draws into
`.dh-panel-output`, the bars `.dh-panel-progress`, the status line `.dh-panel-status` (it reads
"run N: ..." after the N-th run, naming e.g. "100 steps"), and each control
`.dh-panel-<description with dashes>` (`.dh-panel-world-size`, `.dh-panel-steps`, ...).
"""

from __future__ import annotations

import base64
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import ipywidgets as W
import matplotlib.pyplot as plt
from matplotlib.colors import to_hex

import ddp_helpers as dh
from ddp_helpers import data
from ddp_helpers.lessons import gradient_sync_effects as sync_lesson
from ddp_helpers.lessons import mnist_two_gpus as mnist_lesson
from ddp_helpers.plots import gradient_sync_effects as sync_plots
from ddp_helpers.plots import mnist_two_gpus as mnist_plots
from ddp_helpers.plots.common import rank_color

ProgressCallback = Callable[[int, int, int], None]  # (rank, step, steps in all)
_BATCH_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Settings:
    """Lesson 06's panel: one gradient-sync experiment's knobs."""

    world_size: int = 2
    lr: float = 0.01
    batch_size: int = 64
    sync: str = "ddp"  # "ddp", "none" or "average"
    every: int = 10  # for sync="average"
    split: str = "iid"  # "iid" or "by_label"
    steps: int = 100


@dataclass(frozen=True)
class LoaderSettings:
    """Lesson 05's panel: how the data reaches the ranks."""

    world_size: int = 2
    num_workers: int = 2
    batch_size: int = 64
    sampler: bool = True
    loader: str = "DataLoader"  # or "in memory"


# ---------------------------------------------------------------- running with progress


def launch_with_progress(fn, args: tuple, nprocs: int, on_progress: ProgressCallback,
                         progress: Callable[[str], tuple[int, int] | None],
                         timeout: float = 300) -> tuple[list, list[str]]:
    """dh.launch, with each line `progress(line)` reads as (step, total) sent to on_progress;
    returns (results, the ranks' other lines)."""
    other: list[str] = []

    def sink(rank: int, stream: str, line: str) -> None:
        # Called from the launching thread as each line arrives, so the bars move while the
        # ranks run.
        step = progress(line)
        if step is not None:
            on_progress(rank, *step)
        elif line.strip():
            other.append(f"[rank {rank}] {line}")

    results = dh.launch(fn, args=args, nprocs=nprocs, timeout=timeout, output=sink)
    return results, other


def _matcher(pattern: str, total: int | None = None) -> Callable[[str], tuple[int, int] | None]:
    """A progress reader: the regex's groups are (step, total), or (index,) counted from 0."""
    regex = re.compile(pattern)

    def read(line: str) -> tuple[int, int] | None:
        m = regex.search(line)
        if m is None:
            return None
        if total is None:
            return int(m[1]), int(m[2])
        return int(m[1]) + 1, total

    return read


def sync_experiment(settings: Settings, on_progress: ProgressCallback,
                    source: data.DataSource | None = None, train_subset: int = 12_000
                    ) -> list[dict]:
    """Lesson 06's run (train_with_sync) with the panel's settings."""
    cfg = sync_lesson.SyncConfig(
        source=source, sync=settings.sync, every=settings.every, split=settings.split,
        steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr,
        train_subset=train_subset, progress_every=max(1, settings.steps // 25))
    sync_lesson.check_config(cfg, settings.world_size)  # refuse here, before any rank starts
    results, _ = launch_with_progress(sync_lesson.train_with_sync, (settings.world_size, cfg),
                                      settings.world_size, on_progress,
                                      _matcher(r"^progress (\d+)/(\d+)$"))
    return results


def loader_experiment(settings: LoaderSettings, on_progress: ProgressCallback,
                      source: data.DataSource | None = None,
                      train_subset: int = mnist_lesson.NOTEBOOK_SUBSET) -> list[dict]:
    """Lesson 05's run with the panel's settings: one epoch of the first `train_subset` images,
    through the listing's DataLoader (faithful without the sampler, fixed with it) or in memory."""
    if train_subset // settings.world_size < settings.batch_size:
        raise ValueError(f"{train_subset} images give each of {settings.world_size} ranks less "
                         f"than one batch of {settings.batch_size}: fewer ranks or a smaller batch")
    cfg = mnist_lesson.short_config(
        source or data.prepare_data(verbose=False), batch_size=settings.batch_size,
        num_workers=settings.num_workers, train_subset=train_subset, sampler=settings.sampler,
        progress_lines=10, port=dh.free_port())  # the faithful listing's port: a free one here
    per_rank = train_subset if not settings.sampler else math.ceil(
        train_subset / settings.world_size)
    if settings.loader == "in memory":
        fn, read = mnist_lesson.in_memory, _matcher(r"step (\d+)/(\d+)")
    elif settings.sampler:
        fn, read = mnist_lesson.listing_fixed, _matcher(r"step (\d+)/(\d+)")
    else:  # the listing prints "Process <device>, Batch <i>" for every batch
        fn, read = (mnist_lesson.listing_faithful,
                    _matcher(r"Batch (\d+)$", math.ceil(per_rank / settings.batch_size)))
    results, _ = launch_with_progress(fn, (settings.world_size, cfg), settings.world_size,
                                      on_progress, read)
    return [{**r, "dataset": train_subset} for r in results]


# ---------------------------------------------------------------- the panel


class TrainingPanel:
    """Controls, a progress bar per rank, and a figure that is redrawn after every rerun."""

    def __init__(self, experiment: Callable[[object, ProgressCallback], list],
                 controls: dict[str, W.Widget], settings_type: type,
                 draw: Callable[[list], object], summarize: Callable[[list], list[str]],
                 describe: Callable[[object], str], run_now: bool = True):
        self.experiment, self.draw, self.summarize = experiment, draw, summarize
        self.describe, self.settings_type = describe, settings_type
        self.results: list | None = None
        self.figure = None
        self.summary: list[str] = []
        self.error: str | None = None
        self.runs = 0
        self.controls = controls  # settings field -> widget
        self.bars = W.VBox([]).add_class("dh-panel-progress")
        self.status = W.HTML("").add_class("dh-panel-status")
        self.output = W.Output().add_class("dh-panel-output")
        grid = W.GridBox(list(controls.values()),
                         layout=W.Layout(grid_template_columns="repeat(3, 330px)"))
        self.widget = W.VBox([grid, self.bars, self.status, self.output]).add_class("dh-panel")
        for control in controls.values():
            control.observe(self._on_change, names="value")
        if run_now:
            self.rerun()

    def settings(self):
        """The settings the controls show now."""
        return self.settings_type(**{name: c.value for name, c in self.controls.items()})

    def rerun(self) -> None:
        """Run the experiment with the controls' settings and redraw; show errors in the panel."""
        settings = self.settings()
        self._make_bars(settings.world_size)
        self._busy(True, f"running on {settings.world_size} rank(s)...")
        try:
            results = self.experiment(settings, self._progress)
        except (dh.LaunchError, ValueError) as e:
            self.error = str(e)
            self.output.outputs = (_stream(f"The run failed: {e}\n", "stderr"),)
            self._busy(False, "failed: see below; change a setting to try again")
            return
        self._busy(False, f"run {self.runs + 1}: {self.describe(settings)}")
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

    def _make_bars(self, world_size: int) -> None:
        self.bars.children = [
            W.IntProgress(value=0, min=0, max=1, description=f"rank {r}",
                          style={"bar_color": to_hex(rank_color(r))})
            for r in range(world_size)]

    def _busy(self, busy: bool, message: str) -> None:
        for control in self.controls.values():
            control.disabled = busy  # changes made during a run would queue up reruns
        self.status.value = message

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def sync_panel(source: data.DataSource | None = None, defaults: Settings = Settings(),
               train_subset: int = 12_000, run_now: bool = True) -> TrainingPanel:
    """Lesson 06's panel: train with DDP, without sync, or averaging every k; redraw on change."""
    experiment = partial(sync_experiment, source=source, train_subset=train_subset)
    return TrainingPanel(experiment, _sync_controls(defaults), Settings,
                         sync_plots.loss_and_distance_plot, sync_lesson.run_summary,
                         _describe_sync, run_now=run_now)


def loader_panel(source: data.DataSource | None = None,
                 defaults: LoaderSettings = LoaderSettings(),
                 train_subset: int = mnist_lesson.NOTEBOOK_SUBSET,
                 run_now: bool = True) -> TrainingPanel:
    """Lesson 05's panel: one epoch with the chosen data path; samples and time per rank."""
    experiment = partial(loader_experiment, source=source, train_subset=train_subset)
    return TrainingPanel(experiment, _loader_controls(defaults), LoaderSettings,
                         mnist_plots.samples_and_time_plot, loader_summary, _describe_loader,
                         run_now=run_now)


def loader_summary(results: list[dict]) -> list[str]:
    """Per rank: samples seen, steps and the epoch's seconds (the panel's text)."""
    return [f"rank {r['rank']}: {r['samples_seen']:,} of {r['dataset']:,} images in "
            f"{len(r['loss'])} steps, epoch {dh.format_seconds(sum(r['epoch_s']))}"
            for r in results]


# ---------------------------------------------------------------- controls


_STYLE = {"description_width": "100px"}


def _common() -> dict:
    return {"continuous_update": False, "style": _STYLE, "layout": W.Layout(width="320px")}


def _named(controls: list[tuple[str, W.Widget]]) -> dict[str, W.Widget]:
    for _, c in controls:  # e.g. .dh-panel-world-size, for browser tests to find each control
        c.add_class("dh-panel-" + c.description.replace(" ", "-"))
    return dict(controls)


def _sync_controls(d: Settings) -> dict[str, W.Widget]:
    common = _common()
    return _named([
        ("world_size", W.IntSlider(value=d.world_size, min=1, max=4, description="world size",
                                   **common)),
        ("lr", W.FloatLogSlider(value=d.lr, base=10, min=-3, max=0, step=0.1,
                                readout_format=".3g", description="learning rate", **common)),
        ("batch_size", W.SelectionSlider(options=sorted({*_BATCH_SIZES, d.batch_size}),
                                         value=d.batch_size, description="batch size",
                                         **common)),
        ("sync", W.Dropdown(options=[("DDP, every step", "ddp"), ("none", "none"),
                                     ("average every k", "average")], value=d.sync,
                            description="sync", style=_STYLE, layout=common["layout"])),
        ("every", W.IntSlider(value=d.every, min=1, max=50, description="every k", **common)),
        ("split", W.Dropdown(options=[("IID shards", "iid"), ("by label", "by_label")],
                             value=d.split, description="split", style=_STYLE,
                             layout=common["layout"])),
        ("steps", W.IntSlider(value=d.steps, min=10, max=400, step=10, description="steps",
                              **common)),
    ])


def _loader_controls(d: LoaderSettings) -> dict[str, W.Widget]:
    common = _common()
    return _named([
        ("world_size", W.IntSlider(value=d.world_size, min=1, max=4, description="world size",
                                   **common)),
        ("num_workers", W.IntSlider(value=d.num_workers, min=0, max=4, description="workers",
                                    **common)),
        ("batch_size", W.SelectionSlider(options=sorted({*_BATCH_SIZES, d.batch_size}),
                                         value=d.batch_size, description="batch size",
                                         **common)),
        ("sampler", W.Checkbox(value=d.sampler, description="sampler", indent=True,
                               style=_STYLE, layout=common["layout"])),
        ("loader", W.ToggleButtons(options=["DataLoader", "in memory"], value=d.loader,
                                   description="data path", style=_STYLE)),
    ])


def _describe_sync(s: Settings) -> str:
    sync = {"ddp": "sync every step (DDP)", "none": "no sync",
            "average": f"average every {s.every}"}[s.sync]
    return (f"{s.world_size} rank(s), lr {s.lr:.3g}, batch {s.batch_size} per rank, {sync}, "
            f"{'IID shards' if s.split == 'iid' else 'split by label'}, {s.steps} steps")


def _describe_loader(s: LoaderSettings) -> str:
    workers = "" if s.loader == "in memory" else f", {s.num_workers} worker(s) per rank"
    return (f"{s.world_size} rank(s), batch {s.batch_size} per rank, sampler "
            f"{'on' if s.sampler else 'off'}, {s.loader}{workers}")


def _stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def _image(fig) -> dict:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": png, "text/plain": repr(fig)}}


__all__ = ["LoaderSettings", "Settings", "TrainingPanel", "launch_with_progress",
           "loader_experiment", "loader_panel", "loader_summary", "sync_experiment",
           "sync_panel"]
