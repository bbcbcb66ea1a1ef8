"""`%ranks compare`'s table: for each value named, every leaf (a tensor, a module's parameter
or buffer, an optimizer's state, a plain value) with its dtype, shape, a digest per rank and
whether every rank holds the same bytes; then, for the first tensor that differs, where."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..wire.messages import Summary


@dataclass
class Difference:
    """The first element of a leaf that differs between ranks."""

    leaf: str
    index: tuple[int, ...]
    values: dict[int, str]  # rank -> its value there
    largest: float | None = None  # the largest |difference| from rank 0, over the leaf
    largest_at: tuple[int, ...] = ()


@dataclass
class Row:
    """One leaf on every rank."""

    leaf: str
    per_rank: dict[int, Summary]

    @property
    def equal(self) -> bool:
        first = next(iter(self.per_rank.values()))
        return all((s.kind, s.dtype, s.shape, s.digest) == (first.kind, first.dtype, first.shape,
                                                            first.digest)
                   for s in self.per_rank.values()) and first.kind != "missing"


@dataclass
class Comparison:
    """What pool.compare(...) returns: `rows`, `differs` (the leaves that are not the same on
    every rank), `first` (where the first differing tensor differs); prints as a table."""

    ranks: list[int]
    rows: list[Row] = field(default_factory=list)
    first: Difference | None = None

    @property
    def differs(self) -> list[str]:
        return [r.leaf for r in self.rows if not r.equal]

    @property
    def equal(self) -> bool:
        """True if every leaf is the same on every rank."""
        return not self.differs

    def __str__(self) -> str:
        if not self.rows:
            return "nothing to compare"
        width = max(len(r.leaf) for r in self.rows) + 2
        head = (f"{'name'.ljust(width)}{'dtype':<10}{'shape':<14}"
                + "".join(f"rank {r}".ljust(10) for r in self.ranks) + "same on every rank")
        lines = [head]
        for row in self.rows:
            some = next(iter(row.per_rank.values()))
            shape = str(tuple(some.shape)) if some.kind == "tensor" else ""
            cells = "".join(_cell(row.per_rank.get(r)).ljust(10) for r in self.ranks)
            same = "yes" if row.equal else _why(row)
            lines.append(f"{row.leaf.ljust(width)}{some.dtype:<10}{shape:<14}{cells}{same}")
        lines.append(self._summary())
        return "\n".join(lines)

    def _summary(self) -> str:
        if self.equal:
            return f"Every value is the same on ranks {_list(self.ranks)} (bit for bit)."
        text = f"Different across ranks: {', '.join(self.differs)}."
        f = self.first
        if f is not None:
            where = ", ".join(f"rank {r}: {v}" for r, v in f.values.items())
            text += f"\nFirst difference: {f.leaf} at index {_index(f.index)} ({where})"
            if f.largest is not None:
                text += (f"; the largest |difference| from rank {self.ranks[0]} is "
                         f"{f.largest:.4g}, at index {_index(f.largest_at)}")
            text += "."
        return text

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def _cell(s: Summary | None) -> str:
    if s is None or s.kind == "missing":
        return "-"
    return s.digest if s.kind == "tensor" else s.text[:8]


def _why(row: Row) -> str:
    kinds = {s.kind for s in row.per_rank.values()}
    if "missing" in kinds:
        gone = [r for r, s in row.per_rank.items() if s.kind == "missing"]
        return f"NO: missing on rank {_list(gone)} ({row.per_rank[gone[0]].text})"
    if len({(s.dtype, s.shape) for s in row.per_rank.values()}) > 1:
        return "NO: dtype or shape differs"
    return "NO"


def _index(index: tuple[int, ...]) -> str:
    return str(index[0]) if len(index) == 1 else str(index)


def _list(ranks) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks))
