"""Notebook conveniences: show a function's source, load an exercise attempt, reveal solutions."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from types import ModuleType

# notebooks/attempts/<name>.py is where a learner's answer goes (ignored by git)
ATTEMPTS = "attempts"


def show(obj) -> None:
    """Print the source of a function or module, so the notebook never pastes a drifting copy."""
    print(inspect.getsource(obj).rstrip())


def exercise(name: str) -> ModuleType:
    """The learner's attempts/<name>.py if it exists, else the kit's solution; says which."""
    attempt = Path.cwd() / ATTEMPTS / f"{name}.py"
    if attempt.exists():
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # the ranks get this sys.path from launch
        module = importlib.import_module(f"{ATTEMPTS}.{name}")
        module = importlib.reload(module)  # pick up edits between runs
        print(f"checking your attempt: {ATTEMPTS}/{name}.py")
        return module
    print(f"no {ATTEMPTS}/{name}.py yet: checking the kit's solution "
          f"(write yours with %%writefile {ATTEMPTS}/{name}.py)")
    return _solution(name)


def reveal(name: str) -> None:
    """Print the kit's solution to an exercise."""
    show(_solution(name))


def _solution(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"ddp_helpers.solutions.{name}")
    except ModuleNotFoundError as e:
        raise ValueError(f"no exercise called {name!r}: see ddp_helpers/solutions/ for the "
                         "names") from e
