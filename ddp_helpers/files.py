"""Writing files so that a reader never sees half of one: the data folders (MNIST's raw files,
the offline digits) and small files are written beside their place, then renamed into it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_folder(dest: Path) -> Iterator[Path]:
    """Yield an empty folder beside `dest` to fill; on success it replaces `dest` whole (all of
    it or nothing: a half-written folder would look complete next time), on error it is removed.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():  # an older version: replace it whole
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
