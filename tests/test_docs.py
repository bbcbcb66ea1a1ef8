"""The code in README.md and CONTRIBUTING.md is real: every Python example parses, imports what
it imports, and every name it uses from the kit exists (`dh.launch`, `lesson.skewed_arrivals`,
...). Notebook magics are allowed: `%...` lines are skipped, and a `%%ranks` block's body is
rank code that must parse."""

import ast
import importlib
import re
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
