"""A "ranks" check at a second world size: the learner's cells run again on a pool of another
size, which the check starts and stops itself, so that a world size or a rank list written into
an answer FAILs with a case that names the size.

Only the cells the answer needs run again: on rank 0 of the learner's ranks, the cell that last
defined each name the check asked for (`exercises.require`), then, cell by cell, the cells that
define the names those cells use (found with `symtable`, so a function's own locals do not
count). The cells come from linecache, where every `%%ranks` cell is kept as "<cell N>"
(engine.rank.cells). A name that no cell defines (rank, world_size, torch, dist, nn, device, a
builtin) is the second pool's own.
"""

from __future__ import annotations

import builtins
import linecache
import re
import symtable
import sys
import types

from .checks import Case

MOST_CELLS = 20  # an answer spread over more cells than this is checked at one size only
_CELL_NAME = re.compile(r"<cell (\d+)>$")


class NotTried(Exception):
    """The second size could not be tried for a reason that is the kit's, not the answer's."""


def other_size(world_size: int, fixed: int | None = None) -> int:
    """The second world size a check runs at: `fixed` if the exercise needs one (and it differs
    from the learner's), else 3 beside 2 ranks and 2 beside any other number."""
    if fixed is not None and fixed != world_size:
        return fixed
    return 3 if world_size == 2 else 2


# -- on rank 0 of the learner's ranks -------------------------------------------------------------

def cells_for(names: list[str], namespace: dict, cells: dict[int, str] | None = None
              ) -> list[tuple[int, str]] | str:
    """The cells (number, source) to run again, in order, so that `names` are defined as they
    are in `namespace`; or a string saying why the answer cannot be rebuilt. `cells`:
    {N: source}, by default every cell this rank ran. Entry 0, if there is one, imports the
    modules and imported functions the cells use (an `import torch` is not worth a cell)."""
    cells = _cells_run() if cells is None else cells
    uses = {n: _uses(src, f"<cell {n}>") for n, src in cells.items()}
    binds = {n: u[2] for n, u in uses.items()}
    chosen: set[int] = set()
    imports: dict[str, str] = {}
    todo = [(name, None) for name in names]  # (name, needed before this cell, or any time)
    while todo:
        name, before = todo.pop()
        line = _import_line(name, namespace)
        if line:
            imports[name] = line
            continue
        cell = None if name in GIVEN else _last_binding(binds, name, before)
        if cell is None or cell in chosen:
            continue
        chosen.add(cell)
        if len(chosen) > MOST_CELLS:
            return f"your answer uses more than {MOST_CELLS} cells"
        now, later, _ = uses[cell]
        todo += [(n, cell) for n in now] + [(n, None) for n in later]
    unfollowed = _unfollowed(chosen, uses, namespace, set(imports))
    if unfollowed:
        return (f"{unfollowed} is not defined at the top level of any cell, and the kit "
                "rebuilds an answer from its cells")
    preamble = [(0, "\n".join(imports[n] for n in sorted(imports)))] if imports else []
    return preamble + [(n, cells[n]) for n in sorted(chosen)]


def _import_line(name: str, namespace: dict) -> str | None:
    """`import torch.nn.functional as F` for a module, `from math import ceil as ceil` for a
    function or class imported from one; None for what a cell made (to be followed)."""
    value = namespace.get(name)
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if (callable(value) and isinstance(module, str) and module != "__main__"
            and qualname.isidentifier() and getattr(sys.modules.get(module), qualname, None)
            is value):
        return f"from {module} import {qualname} as {name}"
    return None


# Names every rank has without a cell (engine.rank.cells.new_namespace; a served rank's extras)
GIVEN = {"rank", "world_size", "torch", "dist", "nn", "device", "local_rank", "group_rank", "host"}


def _unfollowed(chosen: set[int], uses: dict, namespace: dict, imported: set[str]) -> str | None:
    """A name the chosen cells read that this rank has, but no chosen cell defines (made by
    exec, by globals()[...] = ..., by a magic): the second pool would not have it."""
    bound = set().union(imported, *(uses[n][2] for n in chosen))
    read = set().union(*(uses[n][0] | uses[n][1] for n in chosen)) if chosen else set()
    missing = sorted(n for n in read - bound - GIVEN
                     if n in namespace and not n.startswith("__") and not hasattr(builtins, n))
    return missing[0] if missing else None


def _cells_run() -> dict[int, str]:
    """{N: source} of every cell this rank ran (the kit's check cells bind no learner name)."""
    found = {}
    for key, entry in list(linecache.cache.items()):
        match = _CELL_NAME.match(key) if isinstance(key, str) else None
        if match and len(entry) == 4:
            found[int(match[1])] = "".join(entry[2])
    return found


def _uses(source: str, filename: str) -> tuple[set[str], set[str], set[str]]:
    """(names the cell's top level reads as it runs, global names its functions and classes
    read when called, names its top level defines); all empty for a cell that does not parse."""
    try:
        top = symtable.symtable(source, filename, "exec")
    except SyntaxError:
        return set(), set(), set()
    now = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    later: set[str] = set()
    tables = list(top.get_children())
    while tables:
        table = tables.pop()
        tables += table.get_children()
        for s in table.get_symbols():
            if s.is_global() and s.is_referenced():
                later.add(s.get_name())
            if s.is_declared_global() and s.is_assigned():
                bound.add(s.get_name())
    return now, later, bound


def _last_binding(binds: dict[int, set[str]], name: str, before: int | None) -> int | None:
    """The last cell (before `before`, if given) whose top level defines `name`."""
    cells = [n for n, names in binds.items() if name in names and (before is None or n < before)]
    return max(cells, default=None)


# -- in the notebook's kernel ---------------------------------------------------------------------

def check_at(size: int, name: str, pool, other=None, timeout: float = 30) -> list[Case]:
    """The cases of check `name` at world size `size`: the learner's cells (from `pool`) run
    again on `other` (a running pool of that size) or on a pool started and stopped here.

    Raises NotTried when the answer cannot be rebuilt there (the verdict then says so)."""
    from .engine import current, make_current

    rebuild = "import ddp_helpers.exercises as _ex\n_ex.cells_to_rebuild(globals())"
    cells = pool.run(rebuild, targets=[0], output="none")[0]
    if isinstance(cells, str):
        raise NotTried(cells)
    before = current()
    started = other is None or not other.running  # a failure there may have stopped it
    try:
        if started:
            other = _start(size, pool, timeout)
        failed = _replay(other, pool, cells, size)
        if failed:
            return [failed]
        code = f"import ddp_helpers.exercises as _ex\n_ex.on_rank({name!r}, globals())"
        per_rank = _run(other, code, size, "your answer")
        if isinstance(per_rank, Case):
            return [per_rank]
    finally:
        if started and other is not None:
            other.stop()
        make_current(before)  # the learner's ranks stay the ones %%ranks cells use
    reasons = [r for r in per_rank if isinstance(r, str)]
    if reasons:
        raise NotTried(reasons[0])
    return [Case(f"world size {size}: rank {r}: {c.label}", c.ok, c.detail)
            for r, cases in enumerate(per_rank) for c in cases]


def _start(size: int, pool, timeout: float):
    from .engine import Ranks

    env = {k: v for k, v in getattr(pool, "_env", {}).items() if not k.startswith("DDP_HELPERS_")}
    return Ranks(size, backend="gloo", timeout=timeout, output="none", env=env or None)


def _replay(other, pool, cells: list[tuple[int, str]], size: int) -> Case | None:
    """Run the learner's cells on `other`; a Case for the first that fails there, else None."""
    for number, source in cells:
        if number == 0:  # the imports the cells use
            try:
                other.run(source, output="none")
            except Exception as e:  # noqa: BLE001 - the kit's part: say it, fail nothing
                raise NotTried(f"importing what your cells import failed: {e}") from e
            continue
        label = pool.labels.cell(f"<cell {number}>")
        result = _run(other, source, size, f"your cell {label}", label=label)
        if isinstance(result, Case):
            return result
    return None


def _run(other, code: str, size: int, what: str, label: str | None = None):
    """other.run(code), or a failed Case saying what failed at this world size. A NameError
    means the kit rebuilt too little of the answer: NotTried, not the learner's fault."""
    from .engine import LaunchError

    try:
        return other.run(code, output="none", label=label)
    except LaunchError as e:
        first = (str(e).splitlines() or [""])[0]
        if "NameError" in first:
            raise NotTried(f"{what} needs a name the kit did not rebuild ({first})") from e
        return Case(f"world size {size}", False, f"{what} failed on {size} ranks: {first}")
