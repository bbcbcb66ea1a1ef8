"""Committed notebook outputs show nothing of the machine that ran them, nor the kit's insides.

A learner reads the committed outputs before running anything, and nbval compares them on other
machines: an absolute path (the author's home, a venv's site-packages, the checkout) is noise to
the one and a difference to the other. An error a lesson raises on purpose should read as the
kit's message, not as frames of the launcher, which say nothing about the learner's code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# A path that names a machine: a home folder, the temporary folder, this project's checkout
# (/work/), an installed package's folder. The lookbehind spares relative paths (runs/tmp/, ./tmp/).
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:home|root|Users|tmp|work)/|[A-Za-z]:\\+Users\\+"
                          r"|site-packages|dist-packages")
# The engine's own modules: a relayed rank traceback may show a lesson's or the learner's
# frames, never these.
LAUNCHER_FILE = re.compile(r"ddp_helpers[/\\]engine[/\\](?:\w+[/\\])*\w+\.py")
# IPython's own frame lines ("File .../ddp_helpers/launch.py:62, in launch(...)") in an `error`
# output: an error raised on purpose renders as the kit's message alone. A rank's stack quoted in
# that message ('File "ddp_helpers/lessons/x.py", line 3') is the lesson's code and may stay.
KIT_FRAME = re.compile(r"File [^\s\"]*ddp_helpers[/\\][\w/\\]+\.py:\d+, in ")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
BINARY_MIME = ("image/", "application/pdf")


def output_texts(output: dict) -> list[tuple[str, str]]:
    """(kind, text) for each piece of text an output shows; ANSI colour codes removed."""
    kind = output.get("output_type", "")
    pieces: list[tuple[str, str]] = []
    if kind == "stream":
        pieces.append(("stream", _joined(output.get("text", ""))))
    elif kind == "error":
        pieces.append(("error", f"{output.get('ename', '')}: {output.get('evalue', '')}"))
        pieces += [("traceback", line) for line in output.get("traceback", [])]
    for mime, value in output.get("data", {}).items():
        if not mime.startswith(BINARY_MIME):
            pieces.append((mime, value if isinstance(value, str) else _joined(value)))
    return [(k, ANSI.sub("", text)) for k, text in pieces]


def _joined(value) -> str:
    if isinstance(value, list):
        return "".join(map(str, value))
    return value if isinstance(value, str) else json.dumps(value)


def findings(path: Path) -> list[str]:
    """One line per offending piece of output: notebook, cell index, what, and the text around."""
    found = []
    cells = json.loads(path.read_text())["cells"]
    for index, cell in enumerate(cells):
        for output in cell.get("outputs", []):
            for kind, text in output_texts(output):
                checks = [("machine path", MACHINE_PATH), ("launcher frame", LAUNCHER_FILE)]
                if kind == "traceback":
                    checks.append(("kit frame in a traceback", KIT_FRAME))
                for what, pattern in checks:
                    for m in pattern.finditer(text):
                        found.append(f"{path.name} cell {index} ({kind}): {what}: "
                                     f"...{_around(text, m)}...")
    return list(dict.fromkeys(found))  # an error's message also ends its traceback: once each


def _around(text: str, m: re.Match, width: int = 50) -> str:
    return text[max(0, m.start() - width):m.end() + width].replace("\n", "\\n")


def test_there_are_notebooks_to_scan():
    assert len(NOTEBOOKS) >= 9, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_outputs_show_no_machine_path_and_no_kit_frame(path):
    found = findings(path)
    assert not found, f"{len(found)} finding(s):\n" + "\n".join(found)


def solution_lines() -> dict[str, list[str]]:
    """Each solution's distinctive lines: code and prose of ddp_helpers/solutions/<name>.py
    (25 characters or more, imports left out), what a revealed solution would print."""
    lines = {}
    for path in sorted((ROOT / "ddp_helpers" / "solutions").glob("[!_]*.py")):
        text = [ln.strip() for ln in path.read_text().splitlines()]
        lines[path.stem] = [ln for ln in text if len(ln) >= 25 and not ln.startswith(
            ("import ", "from ", "#"))]
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_outputs_hold_no_solution(path):
    """A solution (or a prediction's answer, told in its solution file) shows only when the
    learner runs dh.reveal; a committed output never has it."""
    shown = "\n".join(text for cell in json.loads(path.read_text())["cells"]
                      for output in cell.get("outputs", []) for _, text in output_texts(output))
    found = []
    for name, lines in solution_lines().items():
        seen = [line for line in lines if line in shown]
        # A line such as `for p in model.parameters():` is any lesson's; half the solution is it
        if len(seen) >= max(2, len(lines) / 2):
            found.append(f"{name}: {len(seen)} of its {len(lines)} lines, e.g. {seen[0]}")
    assert not found, "solution text in committed outputs:\n" + "\n".join(found)


def test_solution_scan_sees_a_revealed_solution(capsys):
    from ddp_helpers import exercises

    exercises.reveal("naive_all_reduce")
    printed = capsys.readouterr().out
    lines = solution_lines()["naive_all_reduce"]
    assert len(lines) >= 3 and all(line in printed for line in lines)


# ---------------------------------------------------------------- the scanner itself


def _notebook(tmp_path: Path, outputs: list[dict]) -> Path:
    path = tmp_path / "nb.ipynb"
    cells = [{"cell_type": "markdown", "source": "x"},
             {"cell_type": "code", "source": "", "outputs": outputs}]
    path.write_text(json.dumps({"cells": cells}))
    return path


def test_scanner_names_cell_kind_and_text(tmp_path):
    path = _notebook(tmp_path, [
        {"output_type": "stream", "name": "stdout", "text": ["data in /home/ada/kit/data\n"]},
        {"output_type": "error", "ename": "RankRaised", "evalue": "rank 1 raised",
         "traceback": ["\x1b[0;32mFile \x1b[0;32m~/kit/ddp_helpers/engine/launch.py:62\x1b[0m, "
                       "in x"]},
        {"output_type": "execute_result",
         "data": {"text/plain": "'/opt/venv/lib/python3.11/site-packages/torch'",
                  "image/png": "iVBORw0KGgo/home/"}},
    ])
    found = findings(path)
    assert found[0].startswith("nb.ipynb cell 1 (stream): machine path: ...data in /home/")
    assert any("(traceback): launcher frame" in f and "ddp_helpers/engine/launch.py:62" in f
               for f in found)
    assert any("(traceback): kit frame in a traceback" in f for f in found)
    assert any("(text/plain): machine path" in f and "site-packages" in f for f in found)
    assert not any("image/png" in f for f in found)  # pictures are not text


def test_scanner_passes_clean_output_and_relative_paths(tmp_path):
    path = _notebook(tmp_path, [
        {"output_type": "stream", "name": "stdout",
         "text": "saved runs/tmp/loss.png and ./tmp/x; see https://example.org/home/page\n"},
        {"output_type": "stream", "name": "stderr",
         "text": '[rank 1]   File "ddp_helpers/lessons/barriers.py", line 40, in skewed\n'},
        {"output_type": "error", "ename": "LaunchTimeout", "evalue": "timeout",
         "traceback": ['LaunchTimeout: timeout\nrank 0:\n  File "ddp_helpers/lessons/x.py", '
                       'line 3, in hangs_on\n']},
    ])
    assert findings(path) == []
