"""The caller's __main__ when it is a script: is this call under its `if __name__ == "__main__":`
guard, and how ranks start from a script that has none.

multiprocessing's spawn and forkserver children re-run the parent's main script (as
`__mp_main__`) before they unpickle anything, so that functions defined in it can be found. In a
script without the guard that re-run starts ranks of its own inside every rank. Persistent ranks
and functions from modules need nothing from the script, so for an unguarded call the ranks start
without it (`main_hidden`); a function or value defined in the script itself does need it, and
is refused before anything starts, with the guard shown (options.check_guarded).
"""

from __future__ import annotations

import ast
import contextlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CallSite:
    """Where a script's top level made the call that is starting ranks."""

    path: str
    line: int
    text: str  # the line as written, stripped

    def where(self) -> str:
        return f"line {self.line} (`{self.text}`)"


def main_is_script() -> bool:
    """True when spawned ranks re-run __main__: a file run as a program (`python x.py`,
    `python -m pkg.x`). Not a notebook, a REPL or `python -c` (no file), nor a package's
    `__main__.py` (`python -m pytest`), which multiprocessing never re-runs."""
    main = sys.modules.get("__main__")
    if main is None or not isinstance(getattr(main, "__file__", None), str):
        return False
    name = getattr(main.__spec__, "name", None)
    return name is None or not (name == "__main__" or name.endswith(".__main__"))


def unguarded_call() -> CallSite | None:
    """The script line that led to this call when it is not under the `__main__` guard, else None
    (also None for notebooks, `python -c` and calls made after the script's top level ran)."""
    if not main_is_script():
        return None
    main = sys.modules["__main__"]
    line = _top_level_line(main.__dict__)
    if line is None:
        return None
    try:
        source = Path(main.__file__).read_text()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return None  # no readable source (a .pyc, a zip): leave multiprocessing to it
    if any(start <= line <= end for start, end in _guarded_ranges(tree)):
        return None
    text = source.splitlines()[line - 1].strip() if line <= len(source.splitlines()) else ""
    return CallSite(main.__file__, line, text)


def _top_level_line(main_globals: dict) -> int | None:
    """The line the script's module-level code is executing now, if it is on this stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            return frame.f_lineno
        frame = frame.f_back
    return None


def _guarded_ranges(tree: ast.Module) -> list[tuple[int, int]]:
    """Line ranges of the bodies of top-level `if __name__ == "__main__":` blocks."""
    ranges = []
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.lineno))
    return ranges


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


@contextlib.contextmanager
def main_hidden():
    """Start processes in this block without telling them about an unguarded main script.

    multiprocessing writes __main__'s name or path into what each child prepares from; with a
    bare stand-in for __main__ there it writes neither, and the child does not re-run the
    script. Only for unguarded calls: a guarded script's ranks still see it, as with mp.spawn."""
    if unguarded_call() is None:
        yield
        return
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real
