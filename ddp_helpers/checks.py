"""Exercise checks: compare a result with the expected one and say how close it is."""

from __future__ import annotations

import torch


def compare(name: str, got, expected, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Print PASS (exact, or close with the largest difference) or FAIL; return if it passed."""
    got_t, exp_t = _as_tensor(got), _as_tensor(expected)
    if got_t.shape != exp_t.shape:
        print(f"FAIL {name}: shape {tuple(got_t.shape)} but expected {tuple(exp_t.shape)}")
        return False
    if got_t.numel() == 0 or torch.equal(got_t, exp_t):
        print(f"PASS {name}: exact")
        return True
    diff = (got_t.double() - exp_t.double()).abs()
    worst = diff.max().item()
    if torch.allclose(got_t.double(), exp_t.double(), rtol=rtol, atol=atol):
        print(f"PASS {name}: close (largest difference {worst:.1e}, within rtol={rtol:g}, "
              f"atol={atol:g})")
        return True
    where = tuple(int(i) for i in torch.nonzero(diff == worst)[0].tolist())
    print(f"FAIL {name}: largest difference {worst:.3g} at index {where} "
          f"(got {got_t.flatten()[diff.flatten().argmax()].item():.6g}, "
          f"expected {exp_t.flatten()[diff.flatten().argmax()].item():.6g})")
    return False


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return torch.stack([t.detach().cpu() for t in x])
    return torch.as_tensor(x)
