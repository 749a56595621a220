"""`train.precision_schedule`: several precisions in one run, e.g. bf16 warm-up, fp8 body, bf16 cool-down.

The syntax (["bf16:2000", "fp8:9500", "bf16"]: bf16 for steps 1-2000, fp8 for 2001-9500,
bf16 to train.steps) is parsed by `trainer.config.phases`.

Each phase is what the checkpoint-and-relaunch pattern does (docs/checkpointing.md), in one
process: the phase's job (a `ResolvedJob` with its precision, and its last step as the step
to stop at and save) is run by a `Trainer` that knows nothing of phases; the next phase
builds a new `Trainer` with its precision (a new model, FP8-converted or not, and optimizer)
that resumes that checkpoint. Every phase's config keeps train.steps = the whole run, so the
LR schedule, the log's step counter and the final checkpoint/export are the run's, not the
phase's. The process group, the run lock and metrics.jsonl are the run's too.

`PrecisionSchedule` holds the phases and makes each phase's job; `trainer.run.train.train` runs
them one Trainer at a time (`run_schedule`), so nothing passes the Trainer class around.

A relaunch of the same command (after a preemption or a kill) resumes the latest checkpoint
and starts in the phase that holds the step after it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import CheckpointError, scan_checkpoints
from trainer.config import JobConfig
from trainer.config.phases import ROLES, Phase, phase_index, resolved_entries, schedule_phases
from trainer.distributed import init_distributed
from trainer.validate import ResolvedJob, validate_job, with_config

logger = logging.getLogger(__name__)


def phase_config(cfg: JobConfig, phases: list[Phase], k: int, *, load_step: int) -> JobConfig:
    """The config of one phase: what a manual relaunch for that phase would run, with train.steps still the whole run.

    load_step: -1 resumes as the run's config says; >= 0 pins the checkpoint (the previous phase's boundary).
    """
    phase, p, c = phases[k], cfg.profiling, cfg.checkpoint
    forward, backward = ROLES.get(phase.precision, (cfg.float8.forward, cfg.float8.backward))
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, mixed_precision=phase.mixed_precision, precision_schedule=[]),
        float8=dataclasses.replace(cfg.float8, forward=forward, backward=backward),
        checkpoint=dataclasses.replace(
            c, load_step=c.load_step if load_step < 0 else load_step,
            # After the first phase the run resumes its own checkpoints, never the seed weights.
            initial_load_path=c.initial_load_path if load_step < 0 else "",
        ),
        # The profiler runs in the phase that holds its window (trainer.config.checks: it is inside one).
        profiling=dataclasses.replace(p, enable=p.enable and phase.first_step <= p.start_step <= phase.last_step),
    )


def resolve_phases(cfg: JobConfig, *, world_size: int) -> list[ResolvedJob]:
    """validate_job for each phase's config (FP8 exclusions and hardware are checked if any phase is fp8),
    before the process group exists; all phases share one ParallelDims, so its meshes are built once."""
    phases = schedule_phases(cfg)
    by_precision: dict[str, ResolvedJob] = {}
    for k, phase in enumerate(phases):
        if phase.precision not in by_precision:
            by_precision[phase.precision] = validate_job(phase_config(cfg, phases, k, load_step=-1),
                                                         world_size=world_size)
    shared = next(iter(by_precision.values())).parallel_dims
    return [dataclasses.replace(by_precision[p.precision], parallel_dims=shared) for p in phases]


def _latest_checkpoint_step(cfg: JobConfig) -> int:
    """The step the run will resume from, as far as the folder says (0 = a fresh run)."""
    c = cfg.checkpoint
    if c.load_step >= 0:
        return c.load_step
    complete, _ = scan_checkpoints(Path(cfg.job.dump_folder) / c.folder)
    return max(complete, default=0)


def validate_run(cfg: JobConfig, *, world_size: int) -> tuple[PrecisionSchedule | None, ResolvedJob | None]:
    """(the schedule, None) with train.precision_schedule (one validated job per phase), else (None, the job)."""
    if cfg.train.precision_schedule:
        return PrecisionSchedule(cfg, world_size=world_size), None
    return None, validate_job(cfg, world_size=world_size)


class PrecisionSchedule:
    """The phases of one run and each phase's job, validated (`resolve_phases`) before the process group exists."""

    def __init__(self, cfg: JobConfig, *, world_size: int):
        self.cfg = cfg
        self.phases = schedule_phases(cfg)
        self._jobs = resolve_phases(cfg, world_size=world_size)

    def start(self) -> int:
        """The step the run resumes from (0: a fresh run), the same on every rank: rank 0 reads the folder and tells
        the others, so every rank builds the same phase's model. Joins the process group to do so."""
        logger.info("precision schedule: %s (train.mixed_precision=%r is not used)", ", ".join(map(str, self.phases)),
                    self.cfg.train.mixed_precision)
        init_distributed(timeout_seconds=self.cfg.distributed.init_timeout_seconds)
        box = [_latest_checkpoint_step(self.cfg) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def phase_of(self, step: int) -> int:
        """The phase that trains the step after `step`."""
        return phase_index(self.phases, step)

    def job(self, k: int, *, load_step: int) -> ResolvedJob:
        """Phase k's job: its precision, stopping (and saving) at its last step; the run's config as config.toml.

        load_step: -1 resumes as the run's config says; >= 0 pins the checkpoint (the previous phase's boundary).
        """
        phase_cfg = phase_config(self.cfg, self.phases, k, load_step=load_step)
        # resolved.toml names the whole schedule with its steps resolved ("fp8:decay" -> "fp8:900").
        resolved = dataclasses.replace(phase_cfg, train=dataclasses.replace(
            phase_cfg.train, precision_schedule=resolved_entries(self.phases)))
        return with_config(self._jobs[k], resolved, run_cfg=self.cfg, stop_step=self.phases[k].last_step)

    def switch(self, k: int, *, saved: bool) -> int:
        """After phase k ended at its boundary: the next phase's load step; a boundary not saved is an error."""
        boundary = self.phases[k].last_step
        if not saved:
            raise CheckpointError(
                f"precision schedule: the checkpoint of step {boundary} failed to save (see above), so the switch "
                f"{self.phases[k].precision} -> {self.phases[k + 1].precision} cannot resume it; relaunch the same "
                "command to resume the latest checkpoint"
            )
        free_memory()
        logger.info("precision schedule: step %d: %s -> %s (rebuilding the model and resuming checkpoint "
                    "step-%d)", boundary, self.phases[k].precision, self.phases[k + 1].precision, boundary)
        return boundary


def free_memory() -> None:
    """The dropped phase's model and optimizer go before the next phase allocates its own: FSDP's hooks make
    reference cycles, which only the cycle collector frees (two 8B models and optimizers would not fit)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
