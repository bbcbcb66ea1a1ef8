"""Exercises: where a learner's answer is read from, how it is checked, and the verdict printed.

Every exercise is checked by one call in its notebook, `dh.check("<name>")` (or
`dh.check("<name>", answer)` for a prediction), and prints exactly one verdict line:
    PASS <name>: <n> cases
    FAIL <name>: <case>: <first wrong value and what was expected>
    NOT ATTEMPTED <name>: <where to write the answer>
The kit's own solution never earns a PASS: with no answer there is nothing to check.

Three kinds of answer, each checked by a function registered with @exercise_check in the lesson
module of the notebook that sets the exercise:
- "file": a module the learner writes with `%%writefile attempts/<name>.py` (needed where ranks
  started by dh.launch must import the function); the check gets that module.
- "ranks": a function the learner defines in a `%%ranks` cell; the check runs on every rank of
  the current persistent ranks and gets the rank's namespace.
- "prediction": a value the learner writes in the notebook; the check gets that value.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import exercise_sizes as sizes
from .checks import Case, case  # noqa: F401 - case is what checks use

ATTEMPTS = "attempts"  # notebooks/attempts/<name>.py; the folder is made on first use
KINDS = ("file", "ranks", "prediction")
_NOTHING = object()
_CHECKED: set[str] = set()  # predictions dh.check has seen an answer to, in this kernel
_REQUIRED: list[str] = []  # on a rank: the names the running check asked require() for


class NotAttempted(Exception):
    """Raised by a check when the learner has not given an answer yet."""


class Unwritten(NotAttempted):
    """A function the check requires is missing or still the template: `state` says which
    (and what to write), `said(cell)` the whole sentence for the cell the answer goes in."""

    def __init__(self, state: str):
        self.state = state
        super().__init__(self.said())

    def said(self, cell: str = "its cell") -> str:
        return f"{self.state}, run {cell}, then this check"


RANKS_CELL = "its %%ranks cell (so that every rank has it)"


@dataclass
class Exercise:
    """A registered exercise: its name, kind and check function."""

    name: str
    kind: str
    check: Callable
    wrong_answer: object = None  # predictions: a plausible wrong answer, for the kit's tests
    hints: tuple[str, ...] = ()  # dh.hint(name) prints them one at a time, in order
    diagnosis: str = ""  # printed after a checked answer (never before): how to find the cause
    other_world_size: int | None = None  # "ranks": the second size, where 3 beside 2 won't do


_REGISTRY: dict[str, Exercise] = {}


def exercise_check(name: str, kind: str, wrong_answer: object = None, *,
                   hints: tuple[str, ...] = (), diagnosis: str = "",
                   other_world_size: int | None = None) -> Callable:
    """Register the decorated function as the check of exercise `name`.

    file: check(module) -> list[Case]; ranks: check(namespace) -> list[Case], run on every
    rank; prediction: check(answer) -> list[Case]. Raise NotAttempted when there is no answer.
    `hints` are shown one per dh.hint(name) call; `diagnosis` is printed after the verdict of an
    answer that was checked (PASS or FAIL), so that the path to the cause comes after the guess.
    A "ranks" check runs on the learner's ranks, then (if every case passed) at a second world
    size (exercise_sizes): 3 beside 2 ranks, else 2, or `other_world_size`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use one of {KINDS}")

    def register(fn: Callable) -> Callable:
        _REGISTRY[name] = Exercise(name, kind, fn, wrong_answer, tuple(hints), diagnosis,
                                   other_world_size)
        return fn

    return register


# -- checking -------------------------------------------------------------------------------

@dataclass
class Verdict:
    """The outcome of one check: "PASS", "FAIL" or "NOT ATTEMPTED", and the line printed."""

    outcome: str
    line: str


def check(name: str, answer: object = _NOTHING, *, pool=None, other=None) -> None:
    """Check the learner's answer to exercise `name` and print one verdict line (and, for an
    exercise that has one, the diagnosis path after a checked answer).

    `pool`: the ranks a "ranks" answer was typed on (the current ones by default); `other`: a
    running pool of the second world size to use instead of starting one (the kit's tests)."""
    verdict = evaluate(name, answer, pool=pool, other=other)
    print(verdict.line, flush=True)
    diagnosis = find(name).diagnosis
    if diagnosis and verdict.outcome != "NOT ATTEMPTED":
        print(f"How to find it: {diagnosis}", flush=True)


_HINTS_SHOWN: dict[str, int] = {}  # exercise -> hints shown so far, in this kernel


def hint(name: str) -> None:
    """Print the next hint for exercise `name` (one per call); after the last, say so."""
    hints = find(name).hints
    shown = _HINTS_SHOWN.get(name, 0)
    if not hints:
        print(f"{name} has no hints: dh.reveal({name!r}) shows the kit's solution.")
    elif shown >= len(hints):
        print(f"No more hints for {name} (all {len(hints)} shown): dh.reveal({name!r}) shows "
              "the kit's solution.")
    else:
        _HINTS_SHOWN[name] = shown + 1
        print(f"Hint {shown + 1} of {len(hints)} for {name}: {hints[shown]}")


def evaluate(name: str, answer: object = _NOTHING, *, pool=None, other=None) -> Verdict:
    """Check exercise `name` (see check) and return the verdict instead of printing it."""
    ex = find(name)
    if ex.kind == "prediction" and answer not in (_NOTHING, None, "", Ellipsis):
        _CHECKED.add(name)  # the learner has committed to an answer: reveal may show it
    try:
        cases, note = _run(ex, answer, pool, other)
    except NotAttempted as e:
        return Verdict("NOT ATTEMPTED", f"NOT ATTEMPTED {name}: {e}")
    except Exception as e:  # noqa: BLE001 - a crashing answer is a wrong answer
        first = (str(e).splitlines() or [""])[0]
        return Verdict("FAIL", f"FAIL {name}: your answer raised {type(e).__name__}: {first}")
    wrong = [c for c in cases if not c.ok]
    if not cases:
        return Verdict("FAIL", f"FAIL {name}: the check found no case to run")
    if wrong:
        return Verdict("FAIL", f"FAIL {name}: {wrong[0].label}: {wrong[0].detail} "
                               f"({len(wrong)} of {len(cases)} cases wrong)")
    return Verdict("PASS", f"PASS {name}: {len(cases)} of {len(cases)} cases{note}")


def _run(ex: Exercise, answer: object, pool, other) -> tuple[list[Case], str]:
    """The cases, and a note for the PASS line (the world sizes a "ranks" check tried)."""
    if ex.kind == "prediction":
        if answer is _NOTHING or answer is None or answer == "" or answer is Ellipsis:
            # The cell above holds a placeholder (`predicted = None`), not nothing: say which.
            where = {None: "in place of None ", Ellipsis: "in place of ... "}.get(answer, "")
            raise NotAttempted(f"write your prediction {where}in the cell above, then run "
                               "this check")
        return ex.check(answer), ""
    if ex.kind == "file":
        module = load_attempt(ex.name)
        if module is None:
            raise NotAttempted(f"write it with %%writefile {ATTEMPTS}/{ex.name}.py, then run "
                               "this check (dh.reveal shows the kit's solution)")
        return ex.check(module), ""
    return _run_at_two_sizes(ex, pool, other)


def _run_at_two_sizes(ex: Exercise, pool, other) -> tuple[list[Case], str]:
    """The learner's ranks first; only an answer right there is tried at the second size."""
    from .engine import current

    pool = pool or current()
    cases = _run_on_ranks(ex, pool)
    if not all(c.ok for c in cases):
        return cases, ""
    size = sizes.other_size(pool.nprocs, ex.other_world_size)
    try:
        more = sizes.check_at(size, ex.name, pool, other)
    except sizes.NotTried as e:
        return cases, f" at world size {pool.nprocs} (not tried at {size}: {e})"
    return cases + more, f" at world sizes {pool.nprocs} and {size}"


def _run_on_ranks(ex: Exercise, pool) -> list[Case]:
    from .engine import LaunchError, start_command

    if pool is None or not pool.running:
        raise NotAttempted(f"no ranks are running: {start_command(pool)}, define your function "
                           "in a %%ranks cell, then run this check")
    code = f"import ddp_helpers.exercises as _ex\n_ex.on_rank({ex.name!r}, globals())"
    try:
        per_rank = pool.run(code, output="none")
    except LaunchError as e:
        raise RuntimeError(f"the ranks failed while checking: {str(e).splitlines()[0]}") from e
    reasons = [r for r in per_rank if isinstance(r, str)]
    if reasons:  # a rank had nothing to check: say why, as that rank said it
        raise NotAttempted(reasons[0])
    return [Case(f"rank {r}: {c.label}", c.ok, c.detail)
            for r, cases in enumerate(per_rank) for c in cases]


def on_rank(name: str, namespace: dict) -> list[Case] | str:
    """Run a "ranks" check on this rank (called by dh.check through the ranks); a string says
    why there was nothing to check here."""
    _REQUIRED.clear()
    try:
        return find(name).check(namespace)
    except Unwritten as e:  # the answer goes in a %%ranks cell: say so where the check says run
        return e.said(RANKS_CELL)
    except NotAttempted as e:
        return f"{e} (in a %%ranks cell, so that every rank has it)"


def cells_to_rebuild(namespace: dict) -> list[tuple[int, str]] | str:
    """On rank 0, after on_rank: the learner's cells that define what the check required, for
    the second world size (exercise_sizes.cells_for)."""
    return sizes.cells_for(list(dict.fromkeys(_REQUIRED)), namespace)


def load_attempt(name: str) -> ModuleType | None:
    """The learner's attempts/<name>.py, freshly imported, or None if it does not exist.
    Creates attempts/ on first use, so `%%writefile attempts/<name>.py` works."""
    folder = Path.cwd() / ATTEMPTS
    folder.mkdir(exist_ok=True)
    if not (folder / f"{name}.py").exists():
        return None
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # the ranks get this sys.path from launch
    # Import afresh every time: the learner edits the file between checks, and another
    # notebook folder may hold another attempts/ (the module's cached path would be stale).
    for cached in [m for m in sys.modules if m == ATTEMPTS or m.startswith(ATTEMPTS + ".")]:
        del sys.modules[cached]
    for stale in (folder / "__pycache__").glob(f"{name}.*.pyc"):
        stale.unlink()  # an edit within the same second could otherwise reuse the old bytecode
    importlib.invalidate_caches()
    return importlib.import_module(f"{ATTEMPTS}.{name}")


def require(namespace_or_module, *names: str):
    """The learner's functions by name, or NotAttempted if one is missing or still a stub.
    The names are kept: a "ranks" check rebuilds them at its second world size."""
    _REQUIRED.extend(names)
    found = []
    for n in names:
        if isinstance(namespace_or_module, dict):
            fn = namespace_or_module.get(n)
        else:
            fn = getattr(namespace_or_module, n, None)
        if fn is None:
            raise Unwritten(f"{n} is not defined yet: write it")
        if _is_stub(fn):
            raise Unwritten(f"{n} is still the template (its body is `...`): write the body")
        found.append(fn)
    return found[0] if len(found) == 1 else found


def _is_stub(fn) -> bool:
    """A function whose body, its docstring aside (one line or several), is only `...`, `pass`
    or `raise NotImplementedError`: the template."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not defs:
        return False
    body = defs[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    if len(body) != 1:
        return False
    only = body[0]
    if isinstance(only, ast.Pass):
        return True
    if isinstance(only, ast.Expr) and isinstance(only.value, ast.Constant):
        return only.value.value is Ellipsis
    return isinstance(only, ast.Raise) and "NotImplementedError" in ast.dump(only)


# -- registry and solutions -----------------------------------------------------------------

def find(name: str) -> Exercise:
    """The registered exercise `name` (lesson modules register theirs on import)."""
    if name not in _REGISTRY:
        _import_lessons()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no exercise called {name!r}; the exercises are: "
                         f"{', '.join(sorted(_REGISTRY))}") from None


def all_exercises() -> dict[str, Exercise]:
    """Every registered exercise, by name."""
    _import_lessons()
    return dict(_REGISTRY)


def _import_lessons() -> None:
    from . import lessons

    for info in pkgutil.iter_modules(lessons.__path__):
        importlib.import_module(f"{lessons.__name__}.{info.name}")


def solution_module(name: str) -> ModuleType:
    """The kit's solution to exercise `name` (ddp_helpers/solutions/<name>.py)."""
    try:
        return importlib.import_module(f"ddp_helpers.solutions.{name}")
    except ModuleNotFoundError as e:
        raise ValueError(f"no solution called {name!r}: see ddp_helpers/solutions/") from e


def solution_source(name: str) -> str:
    """The source text of the kit's solution to exercise `name`."""
    return inspect.getsource(solution_module(name)).rstrip()


def reveal(name: str, *, now: bool = False) -> None:
    """Print the kit's solution to exercise `name`.

    A prediction's answer is printed only once dh.check has seen a prediction for it in this
    kernel, or with now=True: the answer next to the question is no exercise. Notebooks carry
    `# dh.reveal("<name>")` commented out, so that no committed notebook holds a solution."""
    ex = find(name)
    if ex.kind == "prediction" and name not in _CHECKED and not now:
        print(f"Write your prediction and run dh.check({name!r}, ...) first; then "
              f"dh.reveal({name!r}) shows the kit's answer (dh.reveal({name!r}, now=True) shows "
              "it without a prediction).")
        return
    print(f"The kit's solution to {name} (ddp_helpers/solutions/{name}.py):\n")
    print(solution_source(name))
