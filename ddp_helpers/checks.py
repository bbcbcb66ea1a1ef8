"""Comparing a result with the expected one, for lesson checks and exercise checks alike.

A compared notebook output must not depend on the BLAS build or the CPU, so a PASS states the
tolerance it was checked against instead of printing a raw difference; a FAIL names the first
wrong element and what was expected there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    """One checked case: its label, whether it passed, and for a failure what differed."""

    label: str
    ok: bool
    detail: str = ""


def compare(name: str, got, expected, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Print PASS (equal within the stated tolerance) or FAIL (the first wrong value); return
    whether it passed. rtol=0, atol=0 asks for bit-for-bit equality."""
    result = case(name, got, expected, rtol=rtol, atol=atol)
    exact = rtol == 0 and atol == 0
    tolerance = "bit for bit" if exact else f"within rtol={rtol:g}, atol={atol:g}"
    print(f"PASS {name}: equal {tolerance}" if result.ok else f"FAIL {name}: {result.detail}")
    return result.ok


def case(label: str, got, expected, rtol: float = 1e-5, atol: float = 1e-6) -> Case:
    """Compare got with expected (tensors, numbers, lists): exact, or close within rtol/atol.
    A failure names the first wrong element and what was expected there."""
    if got is None and expected is not None:
        return Case(label, False, f"got None, expected {_short(expected)}")
    try:
        got_t, exp_t = _as_tensor(got), _as_tensor(expected)
    except (TypeError, ValueError, RuntimeError):
        ok = got == expected
        return Case(label, ok, "" if ok else f"got {_short(got)}, expected {_short(expected)}")
    if got_t.shape != exp_t.shape:
        return Case(label, False, f"shape {tuple(got_t.shape)}, expected {tuple(exp_t.shape)}")
    close = torch.isclose(got_t.double(), exp_t.double(), rtol=rtol, atol=atol)
    if bool(close.all()):
        return Case(label, True)
    i = int((~close).flatten().nonzero()[0])
    values = f"got {got_t.flatten()[i].item():.6g}, expected {exp_t.flatten()[i].item():.6g}"
    if got_t.dim() == 0:
        return Case(label, False, values)  # a number: no index to name
    where = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), got_t.shape))
    return Case(label, False, f"at index {where[0] if len(where) == 1 else where}: {values}")


def pair_cases(answer, expected: tuple, what: str, labels: tuple[str, str]) -> list[Case]:
    """The cases of a predicted pair: one per element under `labels`, or, for an answer that is
    no pair, one case saying so ("the answer is a pair (`what`)")."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return [case(f"the answer is a pair ({what})", answer, expected)]
    return [case(label, got, want) for label, got, want in zip(labels, answer, expected)]


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return torch.stack([t.detach().cpu() for t in x])
    if isinstance(x, (str, bytes, dict)) or x is None:
        raise TypeError("not numeric")
    return torch.as_tensor(x)


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


