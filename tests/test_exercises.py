"""Every exercise the notebooks name, checked three ways: the kit's solution PASSes, no answer
is NOT ATTEMPTED, and a wrong answer (every function of the solution returning None, or a
plausible wrong prediction) FAILs. Never a PASS the learner did not earn."""

import inspect
import json
import re
from pathlib import Path

import pytest

import ddp_helpers as dh
from ddp_helpers import exercises

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9]*.ipynb"))
CHECK_CALL = re.compile(r"""^dh\.check\(\s*["'](\w+)["']\s*(?:,\s*\w+\s*)?\)\s*$""")
RANKS = 2


def check_cells() -> dict[str, str]:
    """exercise name -> notebook, for every `dh.check("name"...)` cell of every notebook."""
    found = {}
    for nb in NOTEBOOKS:
        for cell in json.loads(nb.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and "dh.check(" in source:
                code = [ln for ln in source.splitlines() if ln.strip() and
                        not ln.lstrip().startswith("#")]
                assert len(code) == 1 and CHECK_CALL.match(code[0]), (
                    f"{nb.name}: a check cell is exactly one dh.check(...) call, got {source!r}")
                found[CHECK_CALL.match(code[0]).group(1)] = nb.name
    return found


NAMED = check_cells()


def test_every_notebook_exercise_is_registered_and_every_registered_one_is_set():
    registered = exercises.all_exercises()
    assert sorted(NAMED) == sorted(registered), (
        f"named in notebooks only: {sorted(set(NAMED) - set(registered))}; "
        f"registered only: {sorted(set(registered) - set(NAMED))}")


@pytest.fixture(scope="module")
def pool():
    with dh.Ranks(RANKS, output="none", timeout=60) as p:
        yield p


def public_functions(module) -> list[str]:
    return [n for n, f in inspect.getmembers(module, inspect.isfunction)
            if not n.startswith("_") and f.__module__ == module.__name__]


def give(name: str, kind: str, source: str | None, folder: Path, pool) -> None:
    """Put `source` where the learner's answer goes (None: no answer at all)."""
    if kind == "file":
        target = folder / exercises.ATTEMPTS / f"{name}.py"
        target.parent.mkdir(exist_ok=True)
        target.unlink(missing_ok=True)
        if source is not None:
            target.write_text(source)
    elif kind == "ranks":
        names = public_functions(exercises.solution_module(name))
        pool.run(f"for _n in {names!r}:\n    globals().pop(_n, None)")
        if source is not None:
            pool.run(source)


def wrong_source(name: str) -> str:
    return "\n".join(f"def {fn}(*args, **kwargs):\n    return None\n"
                     for fn in public_functions(exercises.solution_module(name)))


def verdict(name, kind, source, tmp_path, monkeypatch, pool, answer=None):
    monkeypatch.chdir(tmp_path)
    if kind == "prediction":
        return exercises.evaluate(name, answer)
    give(name, kind, source, tmp_path, pool)
    return exercises.evaluate(name, pool=pool)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_the_kits_solution_passes(name, tmp_path, monkeypatch, pool):
    ex = exercises.find(name)
    solution = exercises.solution_module(name)
    answer = getattr(solution, "answer", None)
    got = verdict(name, ex.kind, exercises.solution_source(name), tmp_path, monkeypatch, pool,
                  answer=answer)
    assert got.outcome == "PASS", got.line


@pytest.mark.parametrize("name", sorted(NAMED))
def test_no_answer_is_not_attempted(name, tmp_path, monkeypatch, pool, capsys):
    ex = exercises.find(name)
    monkeypatch.chdir(tmp_path)
    if ex.kind != "prediction":
        give(name, ex.kind, None, tmp_path, pool)
    dh.check(name, None) if ex.kind == "prediction" else dh.check(name, pool=pool)
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"NOT ATTEMPTED {name}:"), line


@pytest.mark.parametrize("name", sorted(NAMED))
def test_a_wrong_answer_fails(name, tmp_path, monkeypatch, pool):
    ex = exercises.find(name)
    got = verdict(name, ex.kind, wrong_source(name), tmp_path, monkeypatch, pool,
                  answer=ex.wrong_answer)
    assert got.outcome in ("FAIL", "NOT ATTEMPTED"), got.line
    assert got.outcome == "FAIL" or ex.kind == "prediction", got.line


def test_attempts_folder_is_made_on_first_use(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert exercises.load_attempt("anything") is None
    assert (tmp_path / "attempts").is_dir()


def test_reveal_prints_the_solution(capsys):
    exercises.reveal("naive_all_reduce")
    assert "def naive_all_reduce" in capsys.readouterr().out


def test_a_prediction_is_revealed_only_after_a_check_or_on_request(capsys):
    exercises._CHECKED.discard("three_rank_sum")
    answer = exercises.solution_source("three_rank_sum")
    exercises.reveal("three_rank_sum")
    first = capsys.readouterr().out
    assert "run dh.check('three_rank_sum', ...) first" in first and answer not in first
    exercises.check("three_rank_sum")  # no answer: still hidden
    exercises.reveal("three_rank_sum")
    assert answer not in capsys.readouterr().out
    exercises.check("three_rank_sum", 1.0)
    exercises.reveal("three_rank_sum")
    assert answer in capsys.readouterr().out
    exercises._CHECKED.discard("three_rank_sum")
    exercises.reveal("three_rank_sum", now=True)
    assert answer in capsys.readouterr().out


def test_hints_come_one_at_a_time_and_the_diagnosis_only_after_a_checked_answer(capsys):
    name = "hint_probe"

    @exercises.exercise_check(name, "prediction", 1, hints=("first", "second"),
                              diagnosis="the path")
    def _probe(answer):
        return [exercises.case("answer", answer, 2)]

    try:
        exercises.hint(name)
        exercises.hint(name)
        exercises.hint(name)
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "Hint 1 of 2 for hint_probe: first"
        assert out[1] == "Hint 2 of 2 for hint_probe: second"
        assert out[2].startswith("No more hints for hint_probe")
        exercises.check(name)  # no answer: no diagnosis yet
        assert "How to find it" not in capsys.readouterr().out
        exercises.check(name, 1)
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("FAIL hint_probe") and out[1] == "How to find it: the path"
    finally:
        exercises._REGISTRY.pop(name, None)
        exercises._HINTS_SHOWN.pop(name, None)
        exercises._CHECKED.discard(name)


def test_a_template_with_a_docstring_of_several_lines_is_still_the_template(tmp_path):
    # 09's attach_overlap_hooks has a two-line docstring over `...`: not attempted, not an answer
    src = ('def template(model):\n    """Hook every parameter.\n    Return the list."""\n'
           '    ...\n\n'
           'def one_line(model):\n    """One line."""\n    raise NotImplementedError\n\n'
           'def answer(model):\n    """Hook every parameter.\n    Return the list."""\n'
           '    return []\n')
    path = tmp_path / "stubs.py"
    path.write_text(src)
    namespace: dict = {}
    exec(compile(src, str(path), "exec"), namespace)
    for name in ("template", "one_line"):
        with pytest.raises(exercises.NotAttempted, match="still the template"):
            exercises.require(namespace, name)
    assert exercises.require(namespace, "answer") is namespace["answer"]
