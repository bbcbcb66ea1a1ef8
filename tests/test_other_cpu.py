"""The test command's second CPU setting catches what it is there for: a compared output tied to
this CPU's kernels (a digest of trained weights) fails nbval under it, while the same result
compared with a tolerance passes. A small notebook is executed here, then checked both ways."""

import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests.other_cpu import other_setting

TRAIN = """\
import torch
import torch.nn.functional as F
from ddp_helpers.models import param_digest
torch.manual_seed(0)
# GELU, softmax and sums of 64 go through vectorised kernels whose rounding differs per CPU
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
reference = [p.detach().clone() for p in model.parameters()]
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()"""
TIED = "param_digest(model)"  # the exact bits of weights after arithmetic
TOLERANT = ("moved = sum((p - r).abs().sum().item()\n"
            "            for p, r in zip(model.parameters(), reference))\n"
            "print('the weights moved:', moved > 1e-3)")


def nbval(path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env",
                           "-p", "no:cacheprovider", "-q", str(path)],
                          env=env, cwd=path.parent, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s)
                                         for s in (TRAIN, TIED, TOLERANT)])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    path = tmp_path_factory.mktemp("other_cpu") / "tied.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_notebook_passes_on_the_cpu_that_executed_it(executed):
    p = nbval(executed, dict(os.environ))
    assert p.returncode == 0, p.stdout
    assert "3 passed" in p.stdout


def test_under_the_other_setting_only_the_cpu_tied_output_fails(executed):
    other = other_setting()
    if not other:
        pytest.skip("this CPU has no second kernel setting (tests/other_cpu.py)")
    p = nbval(executed, {**os.environ, **other})
    assert p.returncode == 1, p.stdout
    assert "1 failed, 2 passed" in p.stdout, p.stdout
    assert "tied.ipynb::Cell 1" in p.stdout  # the digest, and only the digest
