"""Tracebacks and error messages as a learner should read them: their own code in full, the kit's
plumbing hidden, and nothing that changes with the machine, the Python or the torch version.

What is removed, and why:
- frames of the kit's own launch machinery (a rank's error did not happen there);
- line numbers inside installed libraries: consecutive library frames become one line such as
  "... inside torch", since they differ between torch releases and the learner cannot edit them;
- caret lines (Python 3.11+ underlines the failing expression; 3.10 does not);
- C++ source locations that torch's messages start with ("[/__w/pytorch/.../pair.cc:534] ") and
  the C++ stack that follows "Exception raised from";
- absolute paths: the checkout, the home directory and site-packages are shortened.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

_KIT_ROOT = Path(__file__).resolve().parents[2]  # .../ddp_helpers
# The engine only carries a rank's error to the parent: its frames are plumbing. The teaching
# library's frames (runtime, data, training, the lessons) are the learner's to read.
_ENGINE = "engine"
_FRAME = re.compile(r'^(\s*)File "([^"]+)", line (\d+)(, in (.*))?$')
_CARETS = re.compile(r"^\s*[\^~]+[\s\^~]*$")
_CPP_LOCATION = re.compile(r"\[[^\[\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*")
_CPP_STACK = re.compile(r"\s*Exception raised from .*", re.DOTALL)
_LIB_DIRS = ("site-packages", "dist-packages")


def clean_error_text(text: str) -> str:
    """An exception message without C++ source locations, C++ stacks or machine paths."""
    text = _CPP_STACK.sub("", text)
    text = _CPP_LOCATION.sub("", text)
    return shorten_paths(text).rstrip()


def clean_traceback(text: str) -> str:
    """A formatted Python traceback as the learner should see it (see the module docstring)."""
    out: list[str] = []
    hidden_lib = None  # the library whose frames are being folded, if any
    skip_source = False
    for line in text.rstrip().splitlines():
        frame = _FRAME.match(line)
        if frame:
            indent, path = frame.group(1), frame.group(2)
            kind, name = _classify(path)
            skip_source = kind != "user"
            if kind == "library":
                if hidden_lib != name:
                    out.append(f"{indent}... inside {name}")
                hidden_lib = name
                continue
            hidden_lib = None
            if kind == "plumbing":
                continue
            where = f", in {frame.group(5)}" if frame.group(4) else ""
            out.append(f'{indent}File "{shorten_path(path)}", line {frame.group(3)}{where}')
            continue
        if _CARETS.match(line):
            continue
        if line.startswith("    ") and skip_source:
            continue  # the source line of a hidden frame
        hidden_lib = None
        skip_source = False
        out.append(clean_error_text(line) if line.strip() else line)
    return "\n".join(out)


def _classify(path: str) -> tuple[str, str]:
    """("user" | "plumbing" | "library", a name for a library) for a frame's file path."""
    if path.startswith("<"):
        return "user", ""  # a %%ranks cell, an exec'd string
    p = Path(path)
    parts = p.parts
    if "ddp_helpers" in parts:
        below = parts[len(parts) - parts[::-1].index("ddp_helpers"):]
        return ("plumbing", "") if below[:1] == (_ENGINE,) else ("user", "")
    for marker in _LIB_DIRS:
        if marker in parts:
            i = parts.index(marker)
            top = parts[i + 1] if i + 1 < len(parts) else "a library"
            return "library", Path(top).stem
    stdlib = (os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix))
    if os.path.realpath(path).startswith(stdlib) and "python" in path:
        return "library", "the Python standard library"
    return "user", ""


def shorten_path(path: str) -> str:
    """A path relative to the kit, the working directory or the home directory, else as is."""
    if path.startswith("<"):
        return path
    real = Path(os.path.realpath(path))
    for base, prefix in ((_KIT_ROOT.parent, ""), (Path.cwd().resolve(), ""),
                         (Path.home().resolve(), "~/")):
        try:
            return prefix + str(real.relative_to(base))
        except ValueError:
            continue
    return path


def shorten_paths(text: str) -> str:
    """Replace absolute paths inside free text by their short forms."""
    def one(m: re.Match) -> str:
        path = m.group(0)
        for marker in _LIB_DIRS:
            if f"/{marker}/" in path:
                return path.split(f"/{marker}/", 1)[1]
        return shorten_path(path) if os.path.isabs(path) else path

    return re.sub(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]+", one, text)


_DUMP_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def main_thread_stack(dump: str) -> str:
    """The rank's main thread, from a faulthandler dump of every thread, as a short stack:
    most recent call last, the kit's plumbing dropped, library frames folded into one line
    naming the innermost function (e.g. "... inside torch: barrier")."""
    blocks = re.split(r"\n\s*\n|\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    main = next((b for b in blocks if " in rank_entry" in b), "")
    frames = _DUMP_FRAME.findall(main)[::-1]  # faulthandler prints the newest frame first
    names = [fn for _, _, fn in frames]
    frames = frames[names.index("rank_entry") + 1:] if "rank_entry" in names else frames
    if main and not frames:
        # rank_entry is the newest frame: the function it called has no frame left, so it had
        # returned and its objects were being freed in C++ (e.g. a DDP model releasing its
        # process group, whose destructor joins gloo's threads), where nothing Python shows.
        return ("  (its function had returned: the rank was stuck in C++ code freeing what the "
                "function left behind, such as a process group or a DDP model; with gloo on "
                "torch 2.9 after Python comm hooks, a known hang: call "
                "ddp_helpers.runtime.let_gloo_threads_finish() before the function returns)")
    out: list[str] = []
    folded: tuple[str, str] | None = None  # (library, innermost function) being folded
    for path, line, fn in frames:
        kind, lib = _classify(path)
        if kind == "library":
            if folded and folded[0] != lib:
                out.append(f"  ... inside {folded[0]}: {folded[1]}")
                folded = None
            keep = fn if fn not in ("wrapper", "<module>") else (folded[1] if folded else fn)
            folded = (lib, keep)
            continue
        if folded:
            out.append(f"  ... inside {folded[0]}: {folded[1]}")
            folded = None
        if kind == "user":
            out.append(f'  File "{shorten_path(path)}", line {line}, in {fn}')
    if folded:
        out.append(f"  ... inside {folded[0]}: {folded[1]}")
    return "\n".join(out)
