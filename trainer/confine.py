"""Reads confined to a folder: a file of a checkpoint or export folder that resolves outside it is refused.

A folder may come from someone else; a symlink in it (`__0_0.distcp -> /home/me/.ssh/id_rsa`,
`model.safetensors -> /other/run/...`) would make a load read a file it was never given. The folder
itself is resolved first, so a `checkpoint/` folder that is a symlink to scratch storage, or a step
folder that is one, stays fine; what is refused is a file inside it that resolves elsewhere. A leaf:
callers raise their own error type (CheckpointError, ExportError) with the line returned here.
"""

from __future__ import annotations

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
