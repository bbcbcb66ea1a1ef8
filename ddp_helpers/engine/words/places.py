"""Where something happened, named as the learner knows it. A rank names a cell by the file it
ran as ("<cell 12>": the pool's count, unique); the pool keeps the one map from those names
to the prompt's ("In [5]") and renders every place, traceback and stack with it here, so the
rank side never needs it."""

from __future__ import annotations

import re

from ..wire.messages import Where
from .tracebacks import shorten_path

_CELL_FILE = re.compile(r"<cell \d+>")
_PDB_PLACE = re.compile(r"(<cell \d+>)\((\d+)\)")  # pdb's "<cell 12>(4)<module>()"


class Labels:
    """The pool's map from the file a cell ran as to the learner's name for it."""

    def __init__(self):
        self.names: dict[str, str] = {}  # "<cell 12>" -> "In [5]"

    def name(self, filename: str, label: str | None) -> None:
        """Cell `filename` is the one the learner knows as `label` (None: run from Python)."""
        if label:
            self.names[filename] = label

    def cell(self, filename: str) -> str:
        """"In [5]", or "this cell" for code run from Python (its number is the pool's count,
        which the learner never sees)."""
        return self.names.get(filename, "this cell")

    def place(self, where: tuple[str, int]) -> str:
        """A call's place as the learner sees it: "In [5], line 4", or a short path and line."""
        path, line = where
        if _CELL_FILE.fullmatch(path):
            return f"{self.cell(path)}, line {line}"
        return f"{shorten_path(path)}, line {line}"

    def where(self, info: Where) -> str:
        """A rank's place in its cell: "In [5], line 4: dist.all_reduce(t)"."""
        frame = info.frame
        return f"{self.place((frame.file, frame.line))}: {frame.text}"

    def traceback(self, text: str) -> str:
        """A rank's traceback with each cell's file named as the learner knows it
        ("<cell In [5]>"); cells run from Python keep the pool's number."""
        return _CELL_FILE.sub(lambda m: f"<cell {self.names[m[0]]}>" if m[0] in self.names
                              else m[0], text)


    def pdb(self, text: str) -> str:
        """pdb's output with each cell's place as the learner knows it: "> In [5], line 4,
        <module>()"."""
        text = _PDB_PLACE.sub(lambda m: f"{self.cell(m[1])}, line {m[2]}, ", text)
        return _CELL_FILE.sub(lambda m: self.cell(m[0]), text)


def plain_place(where: tuple[str, int]) -> str:
    """A place outside any cell (a launched function's): a short path and the line."""
    return f"{shorten_path(where[0])}, line {where[1]}"
