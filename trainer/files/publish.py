"""Publishing by rename, and the one rule of what the trainer deletes: a folder it can prove its own partial output.

A save or an export is written into `NAME.tmp` and renamed onto `NAME` when complete. Used by checkpoint saves
(trainer/checkpoint/manager.py), the space check's moves (trainer/checkpoint/space.py) and the export and import
folders (trainer/hf/output_folder.py). Two rules, for every path:

- Nothing is deleted unless it is provably a partial output of this trainer: `start_partial` creates the folder with
  a marker file (`.partial`) before anything is written into it, and `publish` removes the marker just before the
  rename. A `step-N.tmp` or `OUT.tmp` without it (a user's folder, a complete checkpoint someone put there, an
  output published by hand) is moved aside, never removed (`clear_partial`).
- What sits at the published name is moved aside to `NAME.{tag}` (`.old`, `.incomplete`, ...; `-2`, `-3`, ... when
  taken) and returned, so the caller says so in one warning line; it is never deleted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PARTIAL = ".partial"
"""The marker file of a partial output: written first into a new `.tmp` folder, removed just before publishing."""


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


def start_partial(tmp: Path) -> None:
    """Create the new folder `tmp` holding the marker that proves it this trainer's partial output (`is_partial`).
    If the marker cannot be written, the folder (empty, just made) is removed and the OSError raised."""
    tmp.mkdir(parents=True)
    try:
        (tmp / PARTIAL).write_text("a partial output of trainer: removed when found, renamed when complete\n")
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_partial(path: Path) -> bool:
    """`path` is a folder (not a link) that `start_partial` made and `publish` has not published."""
    marker = path / PARTIAL
    return not path.is_symlink() and path.is_dir() and not marker.is_symlink() and marker.is_file()


def clear_partial(tmp: Path, *, tag: str) -> Path | None:
    """Make room for a new partial output at `tmp`: this trainer's partial output there is removed; anything else
    there but an empty folder is moved aside to `tmp.{tag}` (returned: the caller says so in one line), never
    removed."""
    if not os.path.lexists(tmp):
        return None
    if is_partial(tmp):
        shutil.rmtree(tmp)
        return None
    if tmp.is_dir() and not tmp.is_symlink() and not any(tmp.iterdir()):
        tmp.rmdir()  # an empty folder: nothing to lose
        return None
    aside = aside_name(tmp, tag)
    os.replace(tmp, aside)
    return aside


def remove_partial(tmp: Path) -> bool:
    """Remove `tmp` if it is this trainer's partial output (a failed save's or export's); True if it was."""
    if not is_partial(tmp):
        return False
    shutil.rmtree(tmp, ignore_errors=True)
    return True


def publish(tmp: Path, final: Path, *, tag: str) -> Path | None:
    """Rename the complete partial output `tmp` onto `final`, durably. Whatever is at `final` (but an empty folder) is
    moved aside to `final.{tag}` first and returned, never deleted: the caller says so in one warning line."""
    (tmp / PARTIAL).unlink(missing_ok=True)  # complete: from here on it is never removed as partial
    fsync_dir(tmp)
    aside = None
    if os.path.lexists(final) and not (final.is_dir() and not final.is_symlink() and not any(final.iterdir())):
        aside = aside_name(final, tag)
        os.replace(final, aside)
    os.replace(tmp, final)  # onto nothing, or onto an empty folder
    fsync_dir(final.parent)
    return aside
