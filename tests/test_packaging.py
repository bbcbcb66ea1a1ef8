"""The conda environment and pyproject.toml must list the same packages with the same ranges."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    blocks = re.findall(r"(?:dependencies|dev) = \[(.*?)\]", text, flags=re.S)
    return {req for block in blocks for req in re.findall(r'"([^"]+)"', block)}


def _environment_requirements() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    return {line.strip()[2:] for line in lines[start + 1:] if line.startswith("      - ")}


def test_environment_yml_matches_pyproject():
    py, env = _pyproject_requirements(), _environment_requirements()
    assert {"torch>=2.4", "torchvision>=0.19", "jupyterlab>=4.0", "nbval>=0.11"} <= py
    assert py == env, f"only in pyproject: {sorted(py - env)}; only in environment.yml: " \
                      f"{sorted(env - py)}"


def test_torch_is_a_range_not_a_pin():
    assert not any(r.startswith(("torch==", "torchvision==")) for r in _pyproject_requirements())


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), flags=re.M)
