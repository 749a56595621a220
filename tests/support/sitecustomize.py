"""Test-only pause points, loaded by Python at startup when tests/support is on PYTHONPATH.

tests/helpers.py `run_until_paused` puts this folder on PYTHONPATH (only there) and sets
TRAINER_TEST_PAUSE=where:step[:rank]; every process of the run (torchrun's workers
inherit both) then blocks at that point, after printing

    TRAINER_TEST_PAUSE: paused at {where}:{step} on rank {rank}

so the test can SIGKILL it at a known moment. `where` is "step" (after step `step` and
its save) or "save" (inside the save of `step`, after this rank wrote its shard files
and before the save completes). Production code has no hook: this file patches
trainer.checkpoint.manager right after it is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

_TARGET = "trainer.checkpoint.manager"


def _pause(where: str, step: int) -> None:
    import torch.distributed as dist

    parts = os.environ["TRAINER_TEST_PAUSE"].split(":")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if parts[0] != where or int(parts[1]) != step or (len(parts) > 2 and int(parts[2]) != rank):
        return
    print(f"TRAINER_TEST_PAUSE: paused at {where}:{step} on rank {rank}", flush=True)
    time.sleep(3600)


def _patch(module) -> None:
    manager, writer = module.CheckpointManager, module._ChecksummedWriter
    maybe_save, write_data = manager.maybe_save, writer.write_data

    def paused_maybe_save(self, step, **kwargs):
        maybe_save(self, step, **kwargs)
        _pause("step", step)

    def paused_write_data(self, plan, planner):
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


if os.environ.get("TRAINER_TEST_PAUSE"):
    sys.meta_path.insert(0, _PatchOnImport())
