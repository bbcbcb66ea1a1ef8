"""Which parts of the package may import which (README, "How the kit is built"): the engine
(ddp_helpers/engine/) starts, supervises and talks to ranks; the teaching library is what the
lessons use. Lessons and plots reach the engine only through the public API; the engine imports
no lesson, plot or notebook-side module; nothing outside the engine (bench/ included) reaches
past its face (ddp_helpers/engine/__init__.py). Inside the engine, each room imports only the
rooms below it (the wire nothing of the kit, the rank side only the wire and the foundation),
and nowhere in the package does a lower room import a higher one or an import run in a circle.
Read from the source (imports inside functions too), so a new import is caught before it runs.
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
FOUNDATION = {"ddp_helpers.runtime", "ddp_helpers.compat", "ddp_helpers.ledger"}
ENGINE_MAY_USE = FOUNDATION
# The engine's rooms from the bottom up; its top-level modules (launch, ranks, magic, ...) are
# the front, above them all. A room may import itself and the rooms below it.
ENGINE_ROOMS = ["wire", "rank", "sets", "rules", "words"]
# What the rank side may import besides itself: it runs inside every rank, preloaded.
RANK_SIDE_MAY_USE = {"ddp_helpers.engine.wire"} | FOUNDATION
# The package's rooms from the bottom up (a module not listed is the teaching library's).
PACKAGE_ROOMS = {
    "foundation": FOUNDATION,
    "engine": {"ddp_helpers.engine"},
    # The package's face (`import ddp_helpers as dh`, the public API every room may use) and
    # every other top-level module not named here.
    "library": {"ddp_helpers"},
    "lessons": {"ddp_helpers.lessons", "ddp_helpers.solutions"},
    "plots": {"ddp_helpers.plots"},
    "front": {"ddp_helpers.__main__", "ddp_helpers.mnist", "ddp_helpers.serve",
              "ddp_helpers.lab", "ddp_helpers.widgets"},
}
ROOM_ORDER = list(PACKAGE_ROOMS)


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
    ("from ..engine import ranks\n", "ddp_helpers.engine.ranks"),
    ("import ddp_helpers.engine.ranks as r\n", "ddp_helpers.engine.ranks"),
    ("from ddp_helpers import engine\n", "ddp_helpers.engine"),
])
def test_the_lesson_rule_sees_every_spelling_of_an_engine_import(source, expected):
    found = imported(source, "ddp_helpers.lessons.some_lesson")
    assert expected in found and any(within(name, ENGINE) for name in found)
    # dh.launch is a name of the package's face, runtime a module of the teaching library
    assert imported("from .. import launch, runtime\n", "ddp_helpers.lessons.some_lesson") == {
        "ddp_helpers", "ddp_helpers.runtime"}


def engine_room(name: str) -> int:
    """The height of an engine module: its room's place in ENGINE_ROOMS, the front above."""
    parts = name.split(".")
    return ENGINE_ROOMS.index(parts[2]) if len(parts) > 3 and parts[2] in ENGINE_ROOMS \
        else len(ENGINE_ROOMS)


def test_each_engine_room_imports_only_itself_and_the_rooms_below():
    engine = [p for p in sources("engine") if p.name != "__init__.py" or p.parent.name != "engine"]
    bad = []
    for p in engine:
        mine = engine_room(module_name(p))
        for name in sorted(imports_of(p)):
            if within(name, ENGINE) and name != ENGINE and engine_room(name) > mine:
                bad.append(f"{p.relative_to(REPO)} imports {name}, a room above it")
    assert not bad, "\n".join(bad)


def test_the_wire_imports_nothing_of_the_kit_and_the_rank_side_only_the_wire_and_foundation():
    bad = violations(sources("engine/wire"), lambda name: within(name, ENGINE + ".wire"))
    bad += violations(sources("engine/rank"), lambda name: within(name, ENGINE + ".rank") or any(
        within(name, allowed) for allowed in RANK_SIDE_MAY_USE))
    assert not bad, "\n".join(bad)


def package_room(name: str) -> str:
    for room, members in PACKAGE_ROOMS.items():
        if name in members or any(within(name, m) for m in members if m != "ddp_helpers"):
            return room
    return "library"  # a teaching-library module


# Imports back up still to be taken away (each with its reason); the list only shrinks.
KNOWN_BACK_UP = {("ddp_helpers.exercises", "ddp_helpers.lessons")}  # discovery, until a table


def test_no_lower_room_of_the_package_imports_a_higher_one():
    bad = []
    for p in PACKAGE.rglob("*.py"):
        if any(module_name(p) == low for low, _ in KNOWN_BACK_UP):
            continue
        mine = ROOM_ORDER.index(package_room(module_name(p)))
        for name in sorted(imports_of(p)):
            theirs = ROOM_ORDER.index(package_room(name))
            if theirs > mine:
                bad.append(f"{p.relative_to(REPO)} ({ROOM_ORDER[mine]}) imports {name} "
                           f"({ROOM_ORDER[theirs]})")
    assert not bad, "an import back up:\n" + "\n".join(bad)


def test_no_import_runs_in_a_circle():
    graph = {module_name(p): {n for n in imports_of(p) if n != module_name(p)}
             for p in PACKAGE.rglob("*.py")}
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not circles, "modules that import each other, directly or round a circle:\n" + \
        "\n".join(" <-> ".join(sorted(c)) for c in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of `graph` (a package imports its __init__, so
    a package's name stands for its face)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_bench_uses_the_public_api_and_the_teaching_library_only():
    paths = sorted((REPO / "bench").glob("*.py"))
    bad = [f"{p.relative_to(REPO)} imports {name}" for p in paths
           for name in sorted(imported(p.read_text(), f"bench.{p.stem}"))
           if within(name, ENGINE) and name != ENGINE]
    assert not bad, ("bench/ reaches past the engine's face; import from ddp_helpers or "
                     "ddp_helpers.engine:\n" + "\n".join(bad))
