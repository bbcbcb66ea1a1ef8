"""Which parts of the package may import which (README, "How the kit is built"): the engine
(ddp_helpers/engine/) starts, supervises and talks to ranks; the teaching library is what the
lessons use. Lessons and plots reach the engine only through the public API; the engine imports
no lesson, plot or notebook-side module; nothing outside the engine reaches past its face
(ddp_helpers/engine/__init__.py). Read from the source, so a new import is caught before it runs.
"""

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ddp_helpers"
ENGINE = "ddp_helpers.engine"
# What the engine may import from the rest of the kit: the rank side sets up the process group.
# The rank side of the library: the process group, version probes, and the ledger of collectives
# (every rank records its calls there, so that the engine can name a mismatch).
ENGINE_MAY_USE = {"ddp_helpers.runtime", "ddp_helpers.compat", "ddp_helpers.ledger"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """True if `name` is a module or package of the kit (not a name imported from one)."""
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@functools.cache
def face(package: str) -> frozenset[str]:
    """The names a package's __init__.py binds: `from ddp_helpers.engine import launch` takes
    its face's function launch, not the module engine/launch.py."""
    init = REPO.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return frozenset()
    tree = ast.parse(init.read_text())
    return frozenset(alias.asname or alias.name for node in tree.body
                     if isinstance(node, ast.ImportFrom) and node.module  # not `from . import m`
                     for alias in node.names)


def imported(source: str, module: str, package: bool = False) -> set[str]:
    """The kit's modules that `source` (the text of `module`) imports, as absolute names:
    `from ..engine import ranks` is ddp_helpers.engine.ranks, `from .. import launch` (a
    function) is the package ddp_helpers."""
    here = module.split(".") if package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
            modules = {f"{base}.{a.name}" for a in node.names
                       if a.name not in face(base) and is_module(f"{base}.{a.name}")}
            found |= modules if len(modules) == len(names) else modules | {base}
    return {name for name in found if name.split(".")[0] == "ddp_helpers"}


def imports_of(path: Path) -> set[str]:
    return imported(path.read_text(), module_name(path), path.name == "__init__.py")


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (PACKAGE / folder).rglob("*.py"))


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(paths: list[Path], allowed) -> list[str]:
    return [f"{p.relative_to(REPO)} imports {name}" for p in paths
            for name in sorted(imports_of(p)) if not allowed(name)]


def test_lessons_and_plots_use_the_public_api_and_the_teaching_library():
    bad = violations(sources("lessons", "plots", "solutions"),
                     lambda name: not within(name, ENGINE))
    assert not bad, ("a lesson reaches into the engine; use the public API instead "
                     "(`import ddp_helpers as dh`, or `from ddp_helpers import launch`):\n"
                     + "\n".join(bad))


def test_a_lesson_imports_no_other_lesson_and_a_plot_only_its_own():
    def rule(own: str | None):
        return lambda name: not within(name, "ddp_helpers.lessons") or name == own

    bad = [v for p in sources("lessons") for v in violations([p], rule(None))]
    bad += [v for p in sources("plots")
            for v in violations([p], rule(f"ddp_helpers.lessons.{p.stem}"))]
    assert not bad, ("a helper two lessons share belongs in the teaching library (data, models, "
                     "training, collectives, torchrun, ...):\n" + "\n".join(bad))


def test_the_engine_imports_only_itself_and_the_rank_side_of_the_library():
    bad = violations(sources("engine"),
                     lambda name: within(name, ENGINE) or name in ENGINE_MAY_USE)
    assert not bad, "the engine imports lessons or other teaching modules:\n" + "\n".join(bad)


def test_the_rest_of_the_kit_goes_through_the_engines_face():
    outside = [p for p in PACKAGE.rglob("*.py") if not within(module_name(p), ENGINE)]
    bad = violations(outside, lambda name: not within(name, ENGINE) or name == ENGINE)
    assert not bad, ("import the engine's public names from ddp_helpers.engine (or from "
                     "ddp_helpers), not from its modules:\n" + "\n".join(bad))


def test_nothing_of_the_engine_lies_flat_among_the_teaching_modules():
    engine_files = {p.name for p in (PACKAGE / "engine").glob("*.py")} - {"__init__.py"}
    flat = sorted(engine_files & {p.name for p in PACKAGE.glob("*.py")})
    assert not flat, f"engine modules outside ddp_helpers/engine/: {flat}"


@pytest.mark.parametrize("source, expected", [
    ("from ddp_helpers.engine.launch import check_launch\n", "ddp_helpers.engine.launch"),
    ("from ..engine import supervisor\n", "ddp_helpers.engine.supervisor"),
    ("import ddp_helpers.engine.ranks as r\n", "ddp_helpers.engine.ranks"),
    ("from ddp_helpers import engine\n", "ddp_helpers.engine"),
])
def test_the_lesson_rule_sees_every_spelling_of_an_engine_import(source, expected):
    found = imported(source, "ddp_helpers.lessons.some_lesson")
    assert expected in found and any(within(name, ENGINE) for name in found)
    # dh.launch is a name of the package's face, runtime a module of the teaching library
    assert imported("from .. import launch, runtime\n", "ddp_helpers.lessons.some_lesson") == {
        "ddp_helpers", "ddp_helpers.runtime"}
