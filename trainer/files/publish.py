"""Publishing by rename: a folder's entries made durable, and the free name an earlier folder is moved aside to.

A save or an export is written into `NAME.tmp` and renamed onto `NAME` when complete; what was there is moved aside
(`NAME.old`, `NAME.old-2`, ...), never deleted. Used by checkpoint saves (trainer/checkpoint/format.py), the space
check's moves (trainer/checkpoint/space.py) and the export and import folders (trainer/hf/output_folder.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def aside_name(path: Path, tag: str) -> Path:
    """The first free name of `NAME.tag`, `NAME.tag-2`, ... beside `path`: where it is moved aside, never deleted."""
    aside, n = path.with_name(f"{path.name}.{tag}"), 1
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{path.name}.{tag}-{n}")
    return aside


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
