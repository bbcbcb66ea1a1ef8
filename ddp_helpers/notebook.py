"""Notebook conveniences: show a function's source, or the diff between two versions of one."""

from __future__ import annotations

import difflib
import html
import inspect


def show(obj) -> None:
    """Print the source of a function or module, so the notebook never pastes a drifting copy."""
    print(inspect.getsource(obj).rstrip())


def show_diff(before, after, *, context: int = 3) -> None:
    """Show what changed from `before` to `after` (two functions or modules) as a unified diff:
    removed lines in red, added ones in green in JupyterLab, plain "-"/"+" lines elsewhere."""
    from IPython.display import display

    old = inspect.getsource(before).rstrip().splitlines()
    new = inspect.getsource(after).rstrip().splitlines()
    names = (getattr(before, "__qualname__", "before"), getattr(after, "__qualname__", "after"))
    lines = list(difflib.unified_diff(old, new, *names, n=context, lineterm=""))
    display({"text/plain": "\n".join(lines), "text/html": _diff_html(lines)}, raw=True)


_COLOURS = {"+": "#e6ffec", "-": "#ffebe9", "@": "#ddf4ff"}


def _diff_html(lines: list[str]) -> str:
    rows = []
    for line in lines:
        colour = _COLOURS.get(line[:1], "transparent") if not line.startswith(("+++", "---")) \
            else "transparent"
        rows.append(f'<span style="background:{colour};display:block">{html.escape(line)}'
                    "</span>")
    return '<pre style="line-height:1.3">' + "".join(rows) + "</pre>"
