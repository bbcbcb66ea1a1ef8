"""One name per topic: every notebook has its lesson module, plot module and test, named as the
table in CONTRIBUTING.md says, and the notebooks import them under one alias convention."""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(notebooks/[^`]+)` \| `([^`]+)` \| `([^`]+)` \| `([^`]+)` \|$")


def table() -> list[tuple[str, str, str, str]]:
    rows = [ROW.match(line).groups() for line in
            (REPO / "CONTRIBUTING.md").read_text().splitlines() if ROW.match(line)]
    assert rows, "CONTRIBUTING.md has no notebook -> module table"
    return rows


ROWS = table()


def topic(notebook: str) -> str:
    return Path(notebook).stem.split("_", 1)[1]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_each_row_names_files_that_exist_and_share_the_topic(row):
    notebook, lesson, plots, test = row
    name = topic(notebook)
    assert lesson == f"ddp_helpers/lessons/{name}.py"
    assert plots == f"ddp_helpers/plots/{name}.py"
    assert test == f"tests/test_lesson_{name}.py"
    missing = [p for p in row if not (REPO / p).is_file()]
    assert not missing, f"missing: {missing}"


def test_every_notebook_lesson_and_plot_module_is_in_the_table():
    listed = {p for row in ROWS for p in row}
    notebooks = {str(p.relative_to(REPO)) for p in (REPO / "notebooks").glob("[0-9]*.ipynb")}
    lessons = {str(p.relative_to(REPO)) for p in (REPO / "ddp_helpers/lessons").glob("*.py")
               if p.name != "__init__.py"}
    plots = {str(p.relative_to(REPO)) for p in (REPO / "ddp_helpers/plots").glob("*.py")
             if p.name not in ("__init__.py", "common.py")}
    tests = {str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_lesson_*.py")}
    assert not (notebooks | lessons | plots | tests) - listed, "not in CONTRIBUTING's table"


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_notebooks_import_their_modules_as_lesson_and_plots(row):
    source = "\n".join("".join(c["source"]) for c in
                       json.loads((REPO / row[0]).read_text())["cells"]
                       if c["cell_type"] == "code")
    name = topic(row[0])
    for kind, alias in (("lessons", "lesson"), ("plots", "plots")):
        imports = re.findall(rf"from ddp_helpers\.{kind} import (\w+)(?: as (\w+))?", source)
        assert imports, f"{row[0]} does not import its {kind} module"
        for module, as_name in imports:
            assert (module, as_name) == (name, alias), (
                f"{row[0]}: `from ddp_helpers.{kind} import {module} as {as_name}`; the "
                f"convention is `from ddp_helpers.{kind} import {name} as {alias}`")
