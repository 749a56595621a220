"""Reads confined to a folder: a file of a checkpoint or export folder that resolves outside it is refused.

A folder may come from someone else; a symlink in it (`__0_0.distcp -> /home/me/.ssh/id_rsa`,
`model.safetensors -> /other/run/...`) would make a load read a file it was never given. The folder
itself is resolved first, so a `checkpoint/` folder that is a symlink to scratch storage, or a step
folder that is one, stays fine; what is refused is a file inside it that resolves elsewhere. A leaf:
callers raise their own error type (CheckpointError, ExportError) with the line returned here.

`special_file_problem`: what is read must also be a regular file of a bounded size (a FIFO, a device, a
multi-GB file in place of a small JSON file would hang the read or exhaust memory).
"""

from __future__ import annotations

import stat
from pathlib import Path


def outside_problem(path: Path, *, folder: Path | None = None) -> str | None:
    """None when `path` (a file of `folder`, default its parent) resolves inside the resolved folder, else why not."""
    root = (folder if folder is not None else path.parent).resolve()
    if not path.is_symlink() and path.parent.resolve() == root:
        return None  # the common case: a plain file of the folder
    target = path.resolve()
    if root in target.parents:
        return None
    return (f"{path} is a symlink to {target}, outside its folder {root}; refusing to read it (reads are confined "
            "to the folder: copy the file in instead of linking it)")


_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def special_file_problem(path: Path, *, max_bytes: int | None = None, what: str = "file") -> str | None:
    """None when `path` (followed if a symlink) is a regular file of at most `max_bytes`, else why it is not read:
    a FIFO blocks a read forever, /dev/zero never ends, and a file far larger than any genuine one of its kind
    would exhaust memory. A missing file is the caller's to report (None here)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    kind = next((name for test, name in _KINDS if test(st.st_mode)), None)
    if kind or not stat.S_ISREG(st.st_mode):
        return f"{path} is {kind or 'not a regular file'}, not a regular file; refusing to read it as a {what}"
    if max_bytes is not None and st.st_size > max_bytes:
        return f"{path} is {_size(st.st_size)}, more than the {_size(max_bytes)} a {what} may be; refusing to read it"
    return None


def _size(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n:,} bytes"
