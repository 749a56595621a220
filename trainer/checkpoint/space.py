"""Disk space around a save: the checkpoint's size, the free space, pruning, and a full disk said in one line.

A write that runs out of space fails deep inside torch: `torch.save` reports the short write as
`RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`, with the
OSError (ENOSPC, or EFBIG past `ulimit -f`) only in its `__context__`, and DCP pickles a rank's
error to the other ranks, which drops that context. So the writer (writer.ChecksummedWriter)
raises the OSError itself, and the manager turns it into the line docs/checkpointing.md shows:
`no space left on device (this checkpoint needs about X MiB; Y MiB free)`.

Before each save rank 0 compares the checkpoint's size with the free space and warns early (only
warns: free space on a shared filesystem changes under other jobs, and the write itself is what
fails, cleanly). `keep_latest_k` deletes old checkpoints only after a save completes, so a failed
save never costs one; when those deletions would make room, the warning and the error say so.
Pruning keeps this run's trajectory: the checkpoint just written, the one the run resumed from, and
never a later step (a run resumed with `load_step` moves a later trajectory aside first: manager.py).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.checkpoint.format import STEP_DIR, CheckpointError, disk_error, root_cause
from trainer.checkpoint.verify import scan_checkpoints
from trainer.files.publish import aside_name, is_partial

logger = logging.getLogger("trainer.checkpoint")

# Filesystems whose free space other machines change (the check before a save is only a hint there).
SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "ceph", "cephfs", "beegfs", "glusterfs", "cifs", "smb3",
                      "9p", "wekafs", "fuse")


def save_error(e: BaseException) -> BaseException:
    """What a failed save reports: the disk error behind `e` if there is one, else the first rank's own error."""
    return disk_error(e) or root_cause(e)


def checkpoint_bytes(tensors: dict[str, Any], *, group: Any) -> int:
    """About how many bytes a save of `tensors` writes, over all ranks (collective on `group`).

    DCP writes every tensor once, whatever its sharding or replication: the sum of the tensors'
    global sizes, each fqn counted once over the ranks (pipeline stages hold different ones).
    """
    sizes: dict[str, int] = {}

    def walk(tree: dict[str, Any], prefix: str) -> None:
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:  # a DTensor's numel() is the global one
                sizes[prefix + k] = v.numel() * v.element_size()

    walk(tensors, "")
    if dist.get_world_size(group) > 1:
        gathered: list[dict[str, int]] = [{} for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(gathered, sizes, group=group)
        for other in gathered:
            sizes.update(other)
    return sum(sizes.values())


def free_bytes(path: Path) -> int | None:
    """Free bytes (for this user) on the filesystem that holds `path` or its nearest existing parent."""
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return None


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (from /proc/self/mounts; '' if unknown)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    target = os.path.realpath(path)
    for line in mounts:
        fields = line.split()
        if len(fields) > 2:
            point = fields[1].replace("\\040", " ")
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def to_prune(folder: Path, *, newest: int, keep_latest_k: int, resumed: int = -1) -> list[Path]:
    """What prune_checkpoints removes once step-{newest} is complete (it need not exist yet).

    Interrupted saves older than step-{newest} (`.tmp` folders holding the marker every save writes first: one
    without it is not provably a save, and kept); with keep_latest_k = k > 0, the complete checkpoints
    older than step-{newest} but its k - 1 newest. Never step-{newest}, never step-{resumed} (the
    checkpoint this run resumed from: the last one known to load), never a later step.
    """
    complete, incomplete = scan_checkpoints(folder)
    removed = []
    for path, _ in incomplete:
        m = STEP_DIR.match(path.name)
        if m and m.group(2) and int(m.group(1)) < newest and is_partial(path):
            removed.append(path)
    if keep_latest_k > 0:
        older = sorted(step for step in complete if step < newest)
        removed += [complete[step] for step in older[:max(len(older) - (keep_latest_k - 1), 0)] if step != resumed]
    return removed


def prune_checkpoints(folder: Path, *, newest: int, keep_latest_k: int, resumed: int = -1) -> list[Path]:
    """Remove what `to_prune` names (right after step-{newest} became complete); returns it.

    Corrupt checkpoints moved aside (`step-N.corrupt`) and abandoned ones (`step-N.abandoned`) are never removed.
    """
    removed = to_prune(folder, newest=newest, keep_latest_k=keep_latest_k, resumed=resumed)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def move_aside(path: Path, tag: str, *, why: str) -> Path:
    """Rename a checkpoint out of the way (`step-N.{tag}`, `.{tag}-2`, ...), never deleting it; `why` completes
    "{path} ..." in the one-line error if it cannot be moved."""
    aside = aside_name(path, tag)
    try:
        path.rename(aside)
    except OSError as e:
        raise CheckpointError(f"{path} {why} and could not be moved aside to {aside}: {e}") from None
    return aside


def _folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _prune_hint(folder: Path, *, step: int, keep_latest_k: int, resumed: int) -> str:
    """'; keep_latest_k=K deletes step-2 (10.5 MiB) once this save completes: deleting it first makes room', or ''."""
    doomed = [p for p in to_prune(folder, newest=step, keep_latest_k=keep_latest_k, resumed=resumed)
              if not p.name.endswith(".tmp")]
    if not doomed:
        return ""
    mib = sum(_folder_bytes(p) for p in doomed) / 2**20
    names = ", ".join(p.name for p in doomed)
    return (f"; keep_latest_k={keep_latest_k} deletes {names} ({mib:,.1f} MiB) only once this save completes: "
            f"deleting {'it' if len(doomed) == 1 else 'them'} first would make room")


def describe_disk_error(error: OSError, *, folder: Path, step: int, nbytes: int, keep_latest_k: int,
                        resumed: int) -> str:
    """The reason part of a failed save's line, for a disk error (call after the partial folder is removed)."""
    needs = f"this checkpoint needs about {nbytes / 2**20:,.1f} MiB"
    if error.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        cap = ("the filesystem's largest file" if limit == resource.RLIM_INFINITY
               else f"ulimit -f allows {limit / 2**20:,.1f} MiB per file")
        return f"file too large ({cap}; {needs}): raise the limit"
    free = free_bytes(folder)
    what = "disk quota exceeded" if error.errno == errno.EDQUOT else "no space left on device"
    return (f"{what} ({needs}; {'unknown' if free is None else f'{free / 2**20:,.1f} MiB'} free)"
            + _prune_hint(folder, step=step, keep_latest_k=keep_latest_k, resumed=resumed))


def warn_if_short(folder: Path, *, step: int, nbytes: int, keep_latest_k: int, resumed: int) -> None:
    """Before a save (rank 0): warn when the filesystem has less free space than the checkpoint needs."""
    try:
        free = free_bytes(folder)
        if free is None or free >= nbytes:
            return
        fs = filesystem_type(folder)
        shared = next((s for s in SHARED_FILESYSTEMS if fs == s or fs.startswith(s + ".")), None)
        hint = _prune_hint(folder, step=step, keep_latest_k=keep_latest_k, resumed=resumed)
    except OSError as e:  # a hint must never fail a save
        logger.debug("free space check failed: %s", e)
        return
    logger.warning("checkpoint step-%d needs about %.1f MiB and %s has %.1f MiB free: the save will likely fail%s%s",
                   step, nbytes / 2**20, folder, free / 2**20, hint,
                   f" (a {shared} filesystem: other machines change its free space, so this is only a hint)"
                   if shared else "")


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def disk_full_line(error: OSError, *, checkpoint_folder: Path | None) -> str:
    """The one line of a run stopped by a full disk outside a save (run files, metrics.jsonl, TensorBoard, W&B):
    what, where, and the checkpoint the relaunch resumes (saves never write over it: untouched)."""
    where = f" writing {error.filename}" if error.filename else ""
    if error.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        what = "file too large" + where + (f" (ulimit -f allows {_size(limit)} per file)"
                                           if limit != resource.RLIM_INFINITY else "") + ": raise the limit"
    else:
        free = free_bytes(Path(error.filename)) if error.filename else None
        what = ("disk quota exceeded" if error.errno == errno.EDQUOT else "no space left on device") + where + (
            f" ({_size(free)} free)" if free is not None else "") + ": make room"
    complete = scan_checkpoints(checkpoint_folder)[0] if checkpoint_folder is not None else {}
    resume = (f"the run resumes from {complete[max(complete)]}, untouched" if complete
              else "the run has no checkpoint yet and starts over")
    return f"{what} and relaunch the same command; {resume}"
