"""Test-only pause points, loaded by Python at startup when tests/support is on PYTHONPATH.

tests/helpers.py `run_until_paused` puts this folder on PYTHONPATH (only there) and sets
TRAINER_TEST_PAUSE=where:step[:rank]; every process of the run (torchrun's workers
inherit both) then blocks at that point, after printing

    TRAINER_TEST_PAUSE: paused at {where}:{step} on rank {rank}

so the test can SIGKILL it at a known moment. `where` is "step" (after step `step` and
its save) or "save" (inside the save of `step`, after this rank wrote its shard files
and before the save completes).

TRAINER_TEST_SAVE_ERROR=step[:rank] is a full disk instead: in the save of `step`, the
rank's write fails with ENOSPC after leaving a partial file behind.

TRAINER_TEST_WRITE_ERROR=NAME:N is a disk that fills outside a save: the N-th write (counted from 1 over the
process) to a file named NAME (metrics.jsonl, resolved.toml, a TensorBoard events file's prefix
"events.out.tfevents") fails with ENOSPC.

Production code has no hook: this file patches CheckpointManager and ChecksummedWriter
right after trainer.checkpoint.manager is imported, and `open` for TRAINER_TEST_WRITE_ERROR.
"""

from __future__ import annotations

import errno
import importlib.abc
import importlib.util
import os
import sys
import time

_TARGET = "trainer.checkpoint.manager"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _pause(where: str, step: int) -> None:
    spec = os.environ.get("TRAINER_TEST_PAUSE", "")
    if not spec:
        return
    parts, rank = spec.split(":"), _rank()
    if parts[0] != where or int(parts[1]) != step or (len(parts) > 2 and int(parts[2]) != rank):
        return
    print(f"TRAINER_TEST_PAUSE: paused at {where}:{step} on rank {rank}", flush=True)
    time.sleep(3600)


def _maybe_fail(root: str, step: int) -> None:
    spec = os.environ.get("TRAINER_TEST_SAVE_ERROR", "")
    if not spec:
        return
    parts, rank = spec.split(":"), _rank()
    if int(parts[0]) != step or (len(parts) > 1 and int(parts[1]) != rank):
        return
    partial = os.path.join(root, f"__{rank}_partial.distcp")
    with open(partial, "wb") as f:
        f.write(b"\0" * 4096)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), partial)


def _patch(module) -> None:
    manager, writer = module.CheckpointManager, module.ChecksummedWriter  # the writer class lives in writer.py
    maybe_save, write_data = manager.maybe_save, writer.write_data

    def paused_maybe_save(self, step, **kwargs):
        maybe_save(self, step, **kwargs)
        _pause("step", step)

    def paused_write_data(self, plan, planner):
        _maybe_fail(str(self.path), self.step)
        future = write_data(self, plan, planner)  # this rank's shard files are written
        _pause("save", self.step)
        return future

    manager.maybe_save, writer.write_data = paused_maybe_save, paused_write_data


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find the real spec, and patch only once
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("TRAINER_TEST_PAUSE") or os.environ.get("TRAINER_TEST_SAVE_ERROR"):
    sys.meta_path.insert(0, _PatchOnImport())


class _FillingFile:
    """A file whose writes count towards TRAINER_TEST_WRITE_ERROR's N; the N-th raises ENOSPC."""

    writes = 0

    def __init__(self, f, path: str, fail_at: int):
        self._f, self._path, self._fail_at = f, path, fail_at

    def write(self, data):
        _FillingFile.writes += 1
        if _FillingFile.writes >= self._fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _patch_open(spec: str) -> None:
    import builtins
    import io

    name, _, count = spec.rpartition(":")
    real = io.open

    def filling_open(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wa") and os.path.basename(
                os.fsdecode(file)).startswith(name):  # TensorBoard's writer passes bytes
            return _FillingFile(f, os.fsdecode(file), int(count))
        return f

    builtins.open = io.open = filling_open


if os.environ.get("TRAINER_TEST_WRITE_ERROR"):
    _patch_open(os.environ["TRAINER_TEST_WRITE_ERROR"])
