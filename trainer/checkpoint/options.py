"""What CheckpointManager needs of [checkpoint] and job.dump_folder, resolved once by trainer.validate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class CheckpointOptions:
    enable: bool
    """Save checkpoints and resume from the latest complete one."""
    dump_folder: str
    """job.dump_folder: the run's folder."""
    folder: str
    """checkpoint.folder, relative to dump_folder."""
    interval: int
    keep_latest_k: int
    load_step: int
    """-1: the latest complete checkpoint; a precision-schedule phase after the first pins its boundary."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"]
    initial_load_path: str
    model_only: bool
    export_dtype: Literal["float32", "bfloat16"]
    on_save_error: Literal["stop", "continue"]
    allow_unverified: bool
    restart_data: bool
    export_interval: int = 0
    """A Hugging Face export every this many steps, in the background (trainer/checkpoint/exports.py); 0 = off."""
    export_keep_latest_k: int = 0
    resume_check: bool = True
    """Record a probe batch's loss in each checkpoint and check it on resume (trainer/run/resume_check.py)."""

    @property
    def path(self) -> Path:
        """Where the checkpoints are: dump_folder / folder."""
        return Path(self.dump_folder) / self.folder
