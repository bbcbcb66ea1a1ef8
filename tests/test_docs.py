"""The code in README.md and CONTRIBUTING.md is real: every Python example parses, imports what
it imports, and every name it uses from the kit exists (`dh.launch`, `lesson.skewed_arrivals`,
...); and every example runs as the reader would run it: Python blocks as `python example.py`
in a folder of their own, magic blocks in a real kernel, shell commands as written (a slow one
says so in its comment and names the test that runs it)."""

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "CONTRIBUTING.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def blocks() -> list[tuple[str, int, str]]:
    found = []
    for doc in DOCS:
        for i, m in enumerate(BLOCK.finditer((REPO / doc).read_text())):
            found.append((doc, i, m.group(1)))
    return found


BLOCKS = blocks()


def python_of(block: str) -> str:
    """The block without magic lines (a %%ranks cell's body is kept: it is Python too)."""
    return "\n".join("" if line.lstrip().startswith("%") else line
                     for line in block.splitlines())


def aliases(tree: ast.AST) -> dict[str, object]:
    """Names the block binds to kit modules or objects by its imports."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ddp_helpers":
                    bound[a.asname or a.name] = importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddp_helpers"):
            module = importlib.import_module(node.module)
            for a in node.names:
                try:
                    target = getattr(module, a.name)
                except AttributeError:
                    target = importlib.import_module(f"{node.module}.{a.name}")
                bound[a.asname or a.name] = target
    return bound


def test_the_docs_have_python_examples():
    assert {doc for doc, _, _ in BLOCKS} == set(DOCS)


@pytest.mark.parametrize("doc, index, block", BLOCKS, ids=[f"{d}#{i}" for d, i, _ in BLOCKS])
def test_every_kit_name_an_example_uses_exists(doc, index, block):
    tree = ast.parse(python_of(block))
    bound = aliases(tree)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and not hasattr(bound[node.value.id], node.attr):
            missing.append(f"{node.value.id}.{node.attr}")
    assert not missing, f"{doc} example {index} uses names the kit does not have: {missing}"


# -- every example runs as the reader would run it --------------------------------------------

FENCE = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)
# A comment that says why a line or block is not run here, naming what runs it instead.
NOT_RUN = re.compile(r"\((?:not run by the tests|slow): ([^)]+)\)")
# `make` lines: the targets are the test command's own entry points, each run by its recipe's
# command below or by a test of its own.
MAKE_TARGETS = {"run": "its recipe, the first MNIST command, runs below",
                "test": "the test command itself, which runs this file",
                "lab": "tests/test_lab.py", "kernel": "tests/test_lab.py"}


def fenced(lang: str) -> list[tuple[str, int, str]]:
    """(doc, index, body) of every fenced block of `lang` ("" for shell) in the docs."""
    found = []
    for doc in DOCS:
        blocks_ = [m for m in FENCE.finditer((REPO / doc).read_text()) if m.group(1) == lang]
        found += [(doc, i, m.group(2)) for i, m in enumerate(blocks_)]
    return found


def has_magics(block: str) -> bool:
    return any(line.lstrip().startswith("%") for line in block.splitlines())


SCRIPTS = [b for b in fenced("python") if not has_magics(b[2])]


def shell_commands(body: str) -> list[str]:
    """The block's commands, continuation lines joined, comment lines dropped."""
    commands, current = [], ""
    for line in body.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip()
        if current.split("#", 1)[0].rstrip().endswith("\\"):
            current = current.split("#", 1)[0].rstrip()[:-1] + " "
            continue
        if current.strip():
            commands.append(current.strip())
        current = ""
    return commands


SHELL = [(doc, i, cmd) for doc, i, body in fenced("")
         if not NOT_RUN.search(body.splitlines()[0] if body.strip() else "")
         for cmd in shell_commands(body)]


def docs_env(tmp_path) -> dict:
    """The reader's environment, with the offline stand-in digits and no network."""
    from mnist_shared import offline_source

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"DDP_HELPERS_OFFLINE": "1", "DDP_HELPERS_DATA": offline_source().root,
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    return env


def printed_outputs(block: str) -> list[str]:
    """What the block's comments say a print shows: `print(x)  # [3, 3]: ...` -> "[3, 3]"."""
    shown = []
    for line in block.splitlines():
        code, _, comment = line.partition("#")
        if code.strip().startswith("print(") and comment.strip()[:1] in ("[", "(", "{"):
            shown.append(re.match(r"\s*(\S.*?\S)(?::\s|\s{2,}|$)", comment).group(1))
    return shown


@pytest.mark.slow
@pytest.mark.parametrize("doc, index, block", SCRIPTS, ids=[f"{d}#{i}" for d, i, _ in SCRIPTS])
def test_every_python_example_runs_as_a_script(doc, index, block, tmp_path):
    """Saved as example.py and run with `python example.py`, as a reader would: no
    `if __name__ == "__main__":` guard, in a folder of its own."""
    (tmp_path / "example.py").write_text(block)
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=docs_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{doc} example {index} failed:\n{p.stdout}\n{p.stderr}"
    for shown in printed_outputs(block):
        assert shown in p.stdout, f"{doc} example {index} says it prints {shown}:\n{p.stdout}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_the_magic_examples_run_in_a_kernel(doc, tmp_path):
    """A document's magic blocks, in order, as cells of one notebook in a real kernel: the
    line magics first, each `%%ranks` cell on the ranks they started."""
    import nbformat
    from nbclient import NotebookClient

    sources = []
    for _, _, block in fenced("python"):
        if has_magics(block) and block in (REPO / doc).read_text():
            sources += [c for c in re.split(r"\n(?=%%)", block.strip()) if c.strip()]
    sources.append("%ranks stop")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    env_before = dict(os.environ)
    os.environ.update(docs_env(tmp_path))
    try:
        NotebookClient(nb, timeout=180, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "[rank 0] Out: tensor([3.])" in text and "[rank 1] Out: tensor([3.])" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("doc, index, command", SHELL, ids=[f"{d}#{i}:{c[:40]}"
                                                            for d, i, c in SHELL])
def test_every_shell_command_runs_as_written(doc, index, command, tmp_path):
    """Each command of a shell block, in a folder of its own with the kit's environment on
    PATH; a command too slow for the tests says so, and names what runs it instead."""
    skipped = NOT_RUN.search(command)
    if command.startswith("make "):
        target = command.split()[1]
        assert target in MAKE_TARGETS, f"{doc}: `make {target}` is not run by any test"
        assert re.search(rf"^{target}:", (REPO / "Makefile").read_text(), re.M)
        if target == "run":
            recipe = re.search(r"^run:.*\n\t(.*)", (REPO / "Makefile").read_text(), re.M)
            assert recipe.group(1).replace("$(BIN)/", "") in _all_shell_text()
        return
    if skipped:
        runner = re.search(r"tests/\w+\.py", skipped.group(1))
        assert runner and (REPO / runner.group(0)).is_file(), skipped.group(0)
        return
    line = command.split("  #", 1)[0].strip()
    p = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=docs_env(tmp_path),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{doc}: `{line}` failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _all_shell_text() -> str:
    return "\n".join(body for _, _, body in fenced(""))
