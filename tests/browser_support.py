"""A throw-away JupyterLab server and the Playwright steps a learner's clicks turn into.

Used by tests/test_browser.py. The server serves a temporary copy of the notebooks under test
(runs never touch the committed ones), with its own settings, workspace, runtime and kernelspec
directories so the machine's Jupyter configuration cannot change what the test sees. Kernels run
in their own sessions (jupyter_client starts them with setsid) and the ranks they launch in
theirs, so stopping the server's process group alone would leave them: stop() shuts kernels
down through the REST API, then kills every process group the server's tree lives in.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium floods a closed network with refused
# connections; --disable-quic for the same reason.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]
ARTIFACTS = Path(__file__).resolve().parent / "browser-artifacts"
REPO = Path(__file__).resolve().parent.parent

# JupyterLab user settings the test needs: every cell in the DOM (the default windowing drops
# cells scrolled out of view), and no news or update checks (no network here).
_LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin.jupyterlab-settings": {"enabled": False},
}
# In a widget's or output's text: a widget that did not render.
WIDGET_FAILURES = ("Loading widget...", "Error displaying widget", "Failed to load model class")


class LabError(AssertionError):
    """What went wrong with the server or the page, with where to look."""


def poll(what: str, check, timeout: float, interval: float = 0.5):
    """check() until it returns something truthy; raise LabError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise LabError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class LabServer:
    """A running `jupyter lab` on 127.0.0.1 and what is needed to reach and stop it."""

    root: Path
    port: int
    token: str
    proc: subprocess.Popen
    log_path: Path
    seen: set[int] = field(default_factory=set)  # pids of the server's tree, for stop()

    @property
    def base(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        """A lab URL carrying the token (the first visit turns it into a cookie)."""
        sep = "&" if "?" in path else "?"
        return f"{self.base}/{path.lstrip('/')}{sep}token={self.token}"

    def api(self, path: str, method: str = "GET", timeout: float = 10):
        """Call the Jupyter REST API; returns the decoded JSON (None for an empty body)."""
        req = urllib.request.Request(f"{self.base}/api/{path.lstrip('/')}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def kernel_state(self, notebook: str) -> str | None:
        """execution_state of the kernel of the session for `notebook` (None: no session)."""
        for s in self.api("sessions"):
            if s.get("path") == notebook and s.get("kernel"):
                return s["kernel"].get("execution_state")
        return None

    def log_tail(self, n: int = 40) -> str:
        """The last lines of the server's log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"

    def remember_tree(self) -> None:
        """Note every process below the server now; stop() kills the ones still alive."""
        try:
            self.seen.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.Error:
            pass

    def stop(self) -> list[str]:
        """Stop kernels, the server and everything they started; return what survived."""
        self.remember_tree()
        if self.proc.poll() is None:
            try:  # a clean kernel shutdown lets the kernels stop their own ranks first
                for k in self.api("kernels"):
                    self.api(f"kernels/{k['id']}", method="DELETE", timeout=30)
            except (OSError, urllib.error.URLError, ValueError):
                pass
            self.remember_tree()
        groups = {self.proc.pid}  # the server was started as a session leader
        for pid in self.seen:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        groups.discard(os.getpgrp())  # never our own group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            for pid in self.seen:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM and not _alive(self.seen):
                break
        return _alive(self.seen | {self.proc.pid}, wait=5.0)


def _alive(pids: set[int], wait: float = 0.0) -> list[str]:
    """Command lines of the pids still running (zombies count as gone) after up to `wait` s."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid}: {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_jupyter_dirs(state: Path) -> dict[str, str]:
    """Settings, workspaces, runtime, config and a python3 kernelspec of our own."""
    settings = state / "settings"
    for rel, values in _LAB_SETTINGS.items():
        f = settings / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    kernel = state / "data" / "kernels" / "python3"
    kernel.mkdir(parents=True, exist_ok=True)
    # This interpreter, whatever a user-level kernelspec named python3 says.
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python"}))
    for d in ("workspaces", "runtime", "config"):
        (state / d).mkdir(exist_ok=True)
    return {"JUPYTERLAB_SETTINGS_DIR": str(settings),
            "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"),
            "JUPYTER_RUNTIME_DIR": str(state / "runtime"),
            "JUPYTER_CONFIG_DIR": str(state / "config"),
            "JUPYTER_PATH": str(state / "data")}


def start_lab(root: Path, state: Path, timeout: float = 180, tries: int = 3) -> LabServer:
    """Start JupyterLab serving `root` on a free port with a random token; wait until it answers."""
    env = {**os.environ, **_isolated_jupyter_dirs(state), "PYTHONUNBUFFERED": "1"}
    env.pop("JUPYTER_TOKEN", None)
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, as a learner gets it
    last = ""
    for attempt in range(tries):  # the free port can be taken before the server binds it
        port, token = _free_port(), secrets.token_hex(16)
        log_path = state / f"server-{attempt}.log"
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
               f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={root}", "--ServerApp.terminals_enabled=False",
               "--LabApp.news_url=None", "--LabApp.extension_manager=readonly"]
        if os.geteuid() == 0:  # CI containers run as root; JupyterLab refuses that by default
            cmd.append("--allow-root")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        server = LabServer(root=root, port=port, token=token, proc=proc, log_path=log_path)
        try:
            poll("JupyterLab to answer on /api/status",
                 lambda s=server: s.proc.poll() is not None or _answers(s), timeout)
        except LabError:
            server.stop()
            raise LabError(f"JupyterLab did not answer within {timeout:.0f} s; its log "
                           f"({log_path}):\n{server.log_tail()}") from None
        if proc.poll() is None:
            return server
        last = server.log_tail()
        server.stop()
    raise LabError(f"JupyterLab exited at start-up {tries} times; last log:\n{last}")


def _answers(server: LabServer) -> bool:
    try:
        server.api("status", timeout=5)
        return True
    except (OSError, urllib.error.URLError, ValueError):
        return False


def copy_notebooks(names: list[str], root: Path) -> None:
    """Copy notebooks/<name> into root, so runs never modify the committed notebooks; with the
    committed attempts/ folder, which exercise cells write into, as a fresh clone has it."""
    for name in names:
        shutil.copy2(REPO / "notebooks" / name, root / name)
    (root / "attempts").mkdir(exist_ok=True)
    shutil.copy2(REPO / "notebooks" / "attempts" / "README.md", root / "attempts" / "README.md")


def launch_browser(playwright, profile: Path):
    """Headless Debian Chromium with a fresh profile: a persistent context in `profile`."""
    return playwright.chromium.launch_persistent_context(
        str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
        viewport={"width": 1400, "height": 1000}, timeout=120_000)


class LabNotebook:
    """One notebook open in JupyterLab: open, run everything, read what the learner sees."""

    def __init__(self, page, server: LabServer, name: str, artifacts: Path):
        self.page = page
        self.server = server
        self.name = name
        self.stem = Path(name).stem
        self.artifacts = artifacts
        self.cells = nbformat.read(server.root / name, as_version=4).cells
        self.panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        self.console: list[str] = []  # the page's console errors and warnings, for the artifacts
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}")
                if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: self.console.append(f"uncaught: {e}"))

    def open(self, timeout: float = 180) -> None:
        """Open the notebook in the lab and wait for its kernel to be idle."""
        # A workspace per notebook: the lab does not reopen the previous test's notebook.
        self.page.goto(self.server.url(f"lab/workspaces/{self.stem}/tree/{self.name}"),
                       wait_until="domcontentloaded", timeout=timeout * 1000)
        self.panel.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=timeout * 1000)
        poll(f"{self.name}: the kernel to start and go idle",
             lambda: self.server.kernel_state(self.name) == "idle", timeout)
        poll(f"{self.name}: all {len(self.cells)} cells in the page",
             lambda: self.cell_nodes().count() == len(self.cells), 60)

    def cell_nodes(self):
        """Locator of the notebook's cells, in notebook order."""
        return self.panel.locator(".jp-Notebook .jp-Notebook-cell")

    def run_all(self) -> None:
        """Run > Run All Cells, through the menu bar, as a learner does."""
        self.panel.locator(".jp-Notebook").click(position={"x": 5, "y": 5})  # focus this one
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        item = self.page.locator('.lm-Menu-item:has(.lm-Menu-itemLabel:text-is("Run All Cells"))')
        item.wait_for(state="visible", timeout=30_000)
        item.click()

    def prompts(self) -> list[str]:
        """The input prompts of the code cells, e.g. '[3]:', '[*]:', '[ ]:'."""
        return [t.strip() for t in self.panel.locator(".jp-CodeCell .jp-InputPrompt")
                .all_inner_texts()]

    def wait_until_run(self, timeout: float = 600) -> None:
        """Wait until a run has started, no cell is queued or running and the kernel is idle."""
        poll(f"{self.name}: Run All to start", lambda: any(p != "[ ]:" for p in self.prompts()),
             60)
        calm = [0]

        def done() -> bool:
            busy = any("*" in p for p in self.prompts())
            idle = self.server.kernel_state(self.name) == "idle"
            calm[0] = calm[0] + 1 if idle and not busy else 0
            return calm[0] >= 3  # idle three polls in a row: not the gap between two cells

        poll(f"{self.name}: every cell to finish (prompts {self.prompts()})", done, timeout, 1.0)

    def unrun_code_cells(self) -> list[int]:
        """Indices of code cells that show no execution count after the run."""
        nodes = self.cell_nodes()
        return [i for i, c in enumerate(self.cells) if c.cell_type == "code"
                and not re.fullmatch(r"\[\d+\]:",
                                     nodes.nth(i).locator(".jp-InputPrompt").inner_text().strip())]

    def output_text(self, i: int) -> str:
        """Everything cell i shows in its output area, as text."""
        return "\n".join(self.cell_nodes().nth(i).locator(".jp-OutputArea-output")
                         .all_inner_texts())

    def error_outputs(self) -> list[str]:
        """'cell i: first line' for each error or traceback shown by a cell that is not tagged
        raises-exception."""
        found = []
        nodes = self.cell_nodes()
        for i, cell in enumerate(self.cells):
            if cell.cell_type != "code" or "raises-exception" in cell.metadata.get("tags", []):
                continue
            outs = nodes.nth(i).locator(
                '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
            for text in outs.all_inner_texts():
                if "Traceback" in text or re.search(r"^\w+(Error|Exception)\b", text, re.M):
                    found.append(f"cell {i}: {_first_line(text)}")
            for text in nodes.nth(i).locator(".jp-OutputArea-output").all_inner_texts():
                for bad in WIDGET_FAILURES:
                    if bad in text:
                        found.append(f"cell {i}: {bad}")
        return found

    def launching_cells_with_ranks(self, ranks=(0, 1), marker: str = "dh.launch(") -> list[int]:
        """Code cells whose source has `marker` (a launch, or "%%ranks") and that show a
        '[rank r] ...' line for every r in ranks."""
        hits = []
        for i, cell in enumerate(self.cells):
            if cell.cell_type == "code" and marker in cell.source:
                text = self.output_text(i)
                if all(re.search(rf"^\[rank {r}\] ", text, re.M) for r in ranks):
                    hits.append(i)
        return hits

    def cell_images(self, i: int) -> int:
        """How many decoded images cell i's output area shows."""
        imgs = self.cell_nodes().nth(i).locator(".jp-OutputArea-output img")
        return sum(1 for k in range(imgs.count())
                   if imgs.nth(k).evaluate("e => e.complete && e.naturalWidth > 0"))

    def rendered_images(self):
        """Images in output areas that the browser has decoded (naturalWidth > 0)."""
        imgs = self.panel.locator(".jp-OutputArea-output img")
        return [imgs.nth(k) for k in range(imgs.count())
                if imgs.nth(k).evaluate("e => e.complete && e.naturalWidth > 0")]

    def shut_down_kernel(self) -> None:
        """Stop this notebook's kernel (and so its ranks): the next notebook gets the cores."""
        for s in self.server.api("sessions"):
            if s.get("path") == self.name:
                self.server.api(f"sessions/{s['id']}", method="DELETE", timeout=60)

    # The interactive panel: a container with class dh-panel, drawing into dh-panel-output.
    def panel_widget(self, description: str):
        """The panel's control whose description matches `description` (case-insensitive)."""
        label = self.page.locator("label.widget-label, .widget-label-basic span").filter(
            has_text=re.compile(rf"^\s*{re.escape(description)}", re.I))
        return self.panel.locator(".dh-panel .widget-inline-hbox").filter(has=label).first

    def widget_panel(self, timeout: float = 60):
        """The rendered ipywidgets panel (class dh-panel); LabError saying what shows instead."""
        panel = self.panel.locator(".dh-panel").first
        try:
            poll(f"{self.name}: the ipywidgets panel", panel.is_visible, timeout)
        except LabError:
            shown = [t[:150] for t in self.panel.locator(".jp-OutputArea-output").all_inner_texts()
                     if "Box(children=" in t or any(bad in t for bad in WIDGET_FAILURES)]
            raise LabError(f"{self.name}: the ipywidgets panel (class dh-panel) did not render "
                           f"within {timeout:.0f} s; in its place: {shown or 'nothing'}. Is the "
                           "@jupyter-widgets/jupyterlab-manager extension installed and enabled?"
                           ) from None
        return panel

    def panel_images(self) -> list[str]:
        """src of every image the panel's output shows (data: or blob: URLs)."""
        imgs = self.panel.locator(".dh-panel-output img, img.dh-panel-output")
        return [imgs.nth(k).get_attribute("src") or "" for k in range(imgs.count())]

    def nudge_slider(self, description: str) -> tuple[float, float]:
        """Move a panel slider one step with the keyboard (down unless at its minimum), as a
        learner using the arrow keys does; return (value before, value after)."""
        handle = self.panel_widget(description).locator(".noUi-handle")
        handle.wait_for(state="visible", timeout=30_000)
        before = float(handle.get_attribute("aria-valuenow"))
        low = float(handle.get_attribute("aria-valuemin"))
        handle.focus()
        handle.press("ArrowLeft" if before > low else "ArrowRight")
        moved = poll(f"slider {description!r} to move from {before:g}",
                     lambda: [v for v in [float(handle.get_attribute("aria-valuenow"))]
                              if v != before], 10)
        return before, moved[0]

    def wait_for_redraw(self, old: list[str], timeout: float = 600) -> list[str]:
        """Wait until the panel shows different images than `old` and the kernel is idle."""
        calm = [0]

        def redrawn():
            now = self.panel_images()
            changed = bool(now) and all(now) and now != old
            idle = self.server.kernel_state(self.name) == "idle"
            calm[0] = calm[0] + 1 if changed and idle else 0
            return now if calm[0] >= 3 else None

        return poll(f"{self.name}: the panel to rerun and redraw its plot", redrawn, timeout, 1.0)

    def save_console(self) -> Path:
        """Write the page's console errors and warnings next to the screenshots."""
        self.artifacts.mkdir(parents=True, exist_ok=True)
        path = self.artifacts / f"{self.stem}-console.log"
        path.write_text("\n".join(self.console) + "\n")
        return path

    def screenshot(self, label: str, locator=None) -> Path:
        """Save a PNG of the page (or of one element) under the artifacts directory."""
        self.artifacts.mkdir(parents=True, exist_ok=True)
        path = self.artifacts / f"{self.stem}-{label}.png"
        target = locator if locator is not None else self.page
        try:
            target.screenshot(path=str(path), timeout=30_000)
        except Exception as e:  # a screenshot must never hide the real failure
            path.with_suffix(".txt").write_text(f"screenshot failed: {e}\n")
        return path


def _first_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = [ln for ln in lines if re.match(r"^\w+(Error|Exception)\b", ln)]
    return (last[-1] if last else lines[0] if lines else "")[:200]
