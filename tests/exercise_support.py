"""Giving an exercise check an answer as a learner would, for the wrong-answer tests: a file in
attempts/, a function defined on the ranks, or a prediction; and the verdict it earns."""

import inspect
import os
from pathlib import Path

from ddp_helpers import exercises


def public_functions(module) -> list[str]:
    """The public functions a solution module defines (what a learner's answer defines)."""
    return [n for n, f in inspect.getmembers(module, inspect.isfunction)
            if not n.startswith("_") and f.__module__ == module.__name__]


def judge(name: str, source, folder: Path, pool=None, other=None) -> exercises.Verdict:
    """The verdict of exercise `name` on `source` (a prediction: the predicted value), with the
    learner's attempts/ folder in `folder`; a "ranks" answer is typed on `pool` and tried at the
    second world size on `other` (a running pool of that size), or on a pool the check starts."""
    ex = exercises.find(name)
    if ex.kind == "prediction":
        return exercises.evaluate(name, source)
    here = os.getcwd()
    os.chdir(folder)
    try:
        if ex.kind == "file":
            target = folder / exercises.ATTEMPTS / f"{name}.py"
            target.parent.mkdir(exist_ok=True)
            target.write_text(source)
            return exercises.evaluate(name)
        names = public_functions(exercises.solution_module(name))
        forget = f"for _n in {names!r}:\n    globals().pop(_n, None)"
        for ranks in (pool, other):
            if ranks is not None and ranks.running:
                ranks.run(forget)  # an answer must define every name itself
        pool.run(source)
        return exercises.evaluate(name, pool=pool, other=other)
    finally:
        os.chdir(here)


def verdicts(name: str, answers: dict, folder: Path, pool=None, other=None) -> dict[str, str]:
    """{label: verdict line} for each of `answers` ({label: source or prediction})."""
    return {label: judge(name, source, folder, pool, other).line
            for label, source in answers.items()}


def assert_all_fail(name: str, lines: dict[str, str], names_case: dict[str, str]) -> None:
    """Every line is a FAIL that names its case (the text in `names_case[label]`)."""
    wrong = {label: line for label, line in lines.items()
             if not line.startswith(f"FAIL {name}: ") or names_case[label] not in line}
    assert not wrong, "\n".join(f"{label}: {line}" for label, line in wrong.items())


def assert_all_pass(name: str, lines: dict[str, str]) -> None:
    """Every line is a PASS."""
    wrong = {label: line for label, line in lines.items()
             if not line.startswith(f"PASS {name}: ")}
    assert not wrong, "\n".join(f"{label}: {line}" for label, line in wrong.items())
