"""`train.precision_schedule`: several precisions in one run, e.g. bf16 warm-up, fp8 body, bf16 cool-down.

The syntax (["bf16:2000", "fp8:9500", "bf16"]: bf16 for steps 1-2000, fp8 for 2001-9500,
bf16 to train.steps) is parsed by `trainer.precision_phases`.

Each phase is what the checkpoint-and-relaunch pattern does (docs/checkpointing.md), in one
process: the phase's `Trainer` trains until its last step and saves a checkpoint there; the
next phase builds a new `Trainer` with its precision (a new model, FP8-converted or not, and
optimizer) that resumes that checkpoint. Every phase's config keeps train.steps = the whole
run, so the LR schedule, the log's step counter and the final checkpoint/export are the
run's, not the phase's. The process group, the run lock and metrics.jsonl are the run's too.

A relaunch of the same command (after a preemption or a kill) resumes the latest checkpoint
and starts in the phase that holds the step after it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.precision_phases import Phase, parse_precision_schedule, phase_index  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from trainer.config import JobConfig
    from trainer.validate import ResolvedJob

logger = logging.getLogger(__name__)


def phase_config(cfg: JobConfig, phases: list[Phase], k: int, *, load_step: int) -> JobConfig:
    """The config of one phase: what a manual relaunch for that phase would run, with train.steps still the whole run.

    load_step: -1 resumes as the run's config says; >= 0 pins the checkpoint (the previous phase's boundary).
    """
    phase, p, c = phases[k], cfg.profiling, cfg.checkpoint
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, mixed_precision=phase.precision, precision_schedule=[]),
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
    from trainer.validate import validate_job

    phases = parse_precision_schedule(cfg.train.precision_schedule, total_steps=cfg.train.steps)
    by_precision: dict[str, ResolvedJob] = {}
    for k, phase in enumerate(phases):
        if phase.precision not in by_precision:
            by_precision[phase.precision] = validate_job(phase_config(cfg, phases, k, load_step=-1),
                                                         world_size=world_size)
    shared = next(iter(by_precision.values())).parallel_dims
    return [dataclasses.replace(by_precision[p.precision], parallel_dims=shared) for p in phases]


def _latest_checkpoint_step(cfg: JobConfig) -> int:
    """The step the run will resume from, as far as the folder says (0 = a fresh run)."""
    from trainer.checkpoint import scan_checkpoints

    c = cfg.checkpoint
    if c.load_step >= 0:
        return c.load_step
    complete, _ = scan_checkpoints(Path(cfg.job.dump_folder) / c.folder)
    return max(complete, default=0)


def run_precision_schedule(cfg: JobConfig, jobs: list[ResolvedJob], *, trainer_cls: Any) -> Any:
    """Train the whole run phase by phase in this process; returns the last phase's TrainState.

    trainer_cls is trainer.train.Trainer (passed in: this module sits below train.py).
    """
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import CheckpointError
    from trainer.distributed import init_distributed

    phases = parse_precision_schedule(cfg.train.precision_schedule, total_steps=cfg.train.steps)
    logger.info("precision schedule: %s (train.mixed_precision=%r is not used)", ", ".join(map(str, phases)),
                cfg.train.mixed_precision)
    # Rank 0 reads the folder and tells the others, so every rank builds the same phase's model.
    init_distributed(timeout_seconds=cfg.distributed.init_timeout_seconds)
    box = [_latest_checkpoint_step(cfg) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    k, load_step = phase_index(phases, box[0]), -1
    trainer, relaunched = None, box[0] > 0
    # Process-wide switches a phase may flip, reset for each phase as a relaunch would: apply_float8 turns
    # oneDNN off on CPU (for torch._scaled_mm), which would change the matmuls of a later bf16 phase.
    mkldnn = torch.backends.mkldnn.enabled
    try:
        while True:
            torch.backends.mkldnn.enabled = mkldnn
            trainer = trainer_cls(phase_config(cfg, phases, k, load_step=load_step), jobs[k],
                                  end_step=phases[k].last_step, run_cfg=cfg)
            resumed = trainer.state.step  # the same on every rank: rank 0 chose the checkpoint
            if phase_index(phases, resumed) != k:
                # The newest checkpoint failed verification and an older one, from another phase, was loaded.
                logger.warning("precision schedule: resumed step %d, which is in phase %s, not %s: rebuilding",
                               resumed, phases[phase_index(phases, resumed)], phases[k])
                trainer.close()
                trainer, k = None, phase_index(phases, resumed)
                _free_memory()
                continue
            if relaunched:
                logger.info("precision schedule: resuming at step %d in phase %d of %d (%s)", resumed, k + 1,
                            len(phases), phases[k])
                relaunched = False
            state = trainer.run()
            if state.preempted or state.step >= cfg.train.steps:
                return state
            boundary = phases[k].last_step
            assert state.step == boundary, (state.step, boundary)
            trainer.close()  # a background save of the boundary completes here
            saved = trainer.checkpoint.last_saved_step == boundary
            trainer = None
            if not saved:
                raise CheckpointError(
                    f"precision schedule: the checkpoint of step {boundary} failed to save (see above), so the switch "
                    f"{phases[k].precision} -> {phases[k + 1].precision} cannot resume it; relaunch the same command "
                    "to resume the latest checkpoint"
                )
            _free_memory()
            logger.info("precision schedule: step %d: %s -> %s (rebuilding the model and resuming checkpoint "
                        "step-%d)", boundary, phases[k].precision, phases[k + 1].precision, boundary)
            k, load_step = k + 1, boundary
    finally:
        if trainer is not None:
            trainer.close()


def _free_memory() -> None:
    """The dropped phase's model and optimizer go before the next phase allocates its own: FSDP's hooks make
    reference cycles, which only the cycle collector frees (two 8B models and optimizers would not fit)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
