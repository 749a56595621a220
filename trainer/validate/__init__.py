"""One validation pass: everything knowable from the config, the world size, the model's shapes and the data.

The config alone was checked when the JobConfig was built (trainer.config.checks, so a bad TOML
or override fails while parsing, without importing torch); this pass adds the rest:

    precision.py       train.mixed_precision='auto' resolved for the target's GPUs (first: everything after sees it)
    initial.py         checkpoint.initial_load_path's checkpoint.json gives the model's shape ([model], [moe])
    layout.py          degrees x world size x model shapes; the pipeline's stages and schedule
    memory.py          the sharded weights, gradients and optimizer state per rank against the device's memory
    plan.py            the per-rank memory plan (peak estimate) the dry run prints; over a GPU a warning, over a CPU run's
                       share of the host a refusal
    resolve.py         model arguments, FP8 and build options, data sources and [[validation.tasks]]' files (and the
                       checks they need)
    float8_roles.py    FP8 per block and per GEMM role: float8.bf16_first/last_blocks, float8.forward/backward
    options.py         the Trainer's typed options (run, optimizer, scheduler, metrics, validation, profiling,
                       checkpoint): the Trainer reads no JobConfig

    run_files.py       what the run writes beside itself (config.toml, resolved.toml, fp8_layers.json) and the
                       startup lines that describe the precision and the documents

    ranks.py           after the process group exists (the Trainer's first act): every rank's job is rank 0's

`validate_job` runs the first five in that order on every rank before `init_distributed` does any
work; each raises `ConfigError` (or `DataError` for data files) with one line naming the key,
and what it resolves goes to the trainer as a `ResolvedJob`, so nothing is worked out twice.
Lower layers assert these facts; they do not check them again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.checkpoint.options import CheckpointOptions
from trainer.config import JobConfig
from trainer.data.batch_warmup import BatchWarmup
from trainer.data.mix import HeldOutMixture
from trainer.data.sources import SampleSource
from trainer.data.tasks import TaskRows
from trainer.errors import ConfigError
from trainer.models import ModelArgs
from trainer.parallel import BuildOptions, ParallelDims
from trainer.parallel.pipeline_layout import PipelineOptions
from trainer.validate.initial import checkpoint_shape
from trainer.validate.layout import check_model_layout, check_reduce_dtype, resolve_parallel_dims, resolve_pipeline
from trainer.validate.memory import Target, check_fits_device, check_step_fits_device, this_machine
from trainer.validate.options import (
    MetricsOptions, OptimizerOptions, ProfilingOptions, RunOptions, SchedulerOptions, ValidationOptions,
    resolve_options,
)
from trainer.validate.plan import LOWER_THE_PEAK, MemoryPlan, human_size, plan_memory
from trainer.validate.precision import resolve_auto_precision
from trainer.validate.resolve import (absent_shards, check_float8_exclusions, describe_fsdp_choices,
                                      resolve_batch_warmup, resolve_build, resolve_data, resolve_float8, resolve_fsdp,
                                      resolve_model_args, resolve_tasks)
from trainer.validate.run_files import run_file_texts

logger = logging.getLogger(__name__)


GATHERED_FITS = 0.95
"""reshard_after_forward='default' keeps the weights gathered when the plan with them is at most this share of the
device; moe.dispatch='auto' takes the padded all-to-all under the same bound."""
PADDED_EP = 2
"""moe.dispatch='auto' takes the padded all-to-all at this ep only: measured faster than sized there (2x H200,
docs/moe.md); it moves ep times the rows, which larger ep has not been measured to repay."""


@dataclass(frozen=True)
class ResolvedJob:
    """What validation resolved, handed to the trainer so nothing is worked out twice: all the Trainer reads."""

    parallel_dims: ParallelDims
    model_args: ModelArgs
    build: BuildOptions
    data_source: SampleSource
    """The opened, checked sample source (trainer.data.sources, or a trainer.data.mix.MixtureSource)."""
    run: RunOptions
    optimizer: OptimizerOptions
    scheduler: SchedulerOptions
    metrics: MetricsOptions
    profiling: ProfilingOptions
    checkpoint: CheckpointOptions
    run_files: tuple[tuple[str, str], ...]
    """(name, text) of config.toml, resolved.toml and (fp8) fp8_layers.json (run_files.py), written by rank 0."""
    validation: ValidationOptions | None = None
    """When validation.enable."""
    validation_source: SampleSource | HeldOutMixture | None = None
    """The held-out source when validation.enable (never overlaps data_source)."""
    tasks: tuple[TaskRows, ...] = ()
    """[[validation.tasks]] read and tokenized into rows (when validation.enable)."""
    pipeline: PipelineOptions | None = None
    """The stage layout and schedule when distributed.pp > 1."""
    float8_layers: dict[str, str] | None = None
    """fp8 runs: every Linear's fqn -> "converted" or why it is excluded, in model order."""
    memory_plan: MemoryPlan | None = None
    """The per-rank memory estimate (trainer.validate.plan)."""
    unchecked_data: tuple[str, ...] = ()
    """A dry run: the data keys whose files are not on this machine (data_source is None then)."""
    fsdp_choices: str = ""
    """The startup line on FSDP2's automatic choices ("" where none applies)."""
    model_source: str | None = None
    """The startup line saying the model's shape is checkpoint.initial_load_path's (trainer.validate.initial)."""
    batch_warmup: BatchWarmup | None = None
    """The microbatches of each step (train.batch_size_warmup_tokens' ramp; validate_job always sets it)."""


def validate_job(cfg: JobConfig, *, world_size: int, target: Target | None = None) -> ResolvedJob:
    """Check everything that needs the world size, the model's shapes or the data; resolve what the build and the
    Trainer take. target: where the job runs (None: this machine; a dry run passes the GPUs it plans for)."""
    target = target or this_machine()
    given, cfg = cfg, resolve_auto_precision(cfg, target)  # train.mixed_precision='auto': this target's choice
    # checkpoint.initial_load_path's model gives the shape: the config's [model] and [moe] become the checkpoint's.
    if shape := checkpoint_shape(cfg, planning=target.planning):
        cfg = shape.cfg
    pd = resolve_parallel_dims(cfg, world_size=world_size)
    batch_warmup = resolve_batch_warmup(cfg, dp=pd.dp)
    args = resolve_model_args(cfg)
    check_model_layout(cfg, args, pd)
    check_reduce_dtype(cfg, pd)
    # Before anything walks the blocks (pipeline costs, the FP8 meta model): 10**8 of them take minutes.
    check_fits_device(cfg, args, pd, target.memory)
    check_step_fits_device(cfg, args, pd, target.memory)
    pipeline = resolve_pipeline(cfg, pp=pd.pp, args=args)
    float8, float8_layers = (resolve_float8(cfg, args, pd, probe=target.probe, ranks_per_node=target.ranks_per_node)
                             if cfg.train.is_fp8 else (None, None))
    if not cfg.train.is_fp8:
        check_float8_exclusions(cfg, args)
    build = resolve_build(cfg, pd, float8, cuda=target.device_type == "cuda", ranks_per_node=target.ranks_per_node)
    cpu = target.device_type == "cpu"
    plan = plan_memory(cfg, args, pd, build, pipeline, float8_layers, cpu=cpu)
    if (cfg.distributed.reshard_after_forward == "default" and pd.fsdp_shard > 1 and not build.fsdp.reshard_after_forward
            and target.memory and plan.peak_bytes > GATHERED_FITS * target.memory[0]):
        # The default keeps gathered weights where they fit (with the plan's error to spare: docs/benchmarks.md holds
        # it against measured peaks); where they do not it reshards (ZeRO-3).
        build = dataclasses.replace(build, fsdp=resolve_fsdp(cfg, pd, bf16_master=build.fsdp.master_dtype == torch.bfloat16,
                                                             ranks_per_node=target.ranks_per_node,
                                                             keep_gathered_fits=False))
        plan = plan_memory(cfg, args, pd, build, pipeline, float8_layers, cpu=cpu)
    if cfg.moe.dispatch == "auto" and pd.ep > 1:
        build, plan = _auto_dispatch(
            cfg, args, pd, build, plan, target,
            lambda padded: plan_memory(cfg, args, pd, padded, pipeline, float8_layers, cpu=cpu))
    if target.memory and plan.peak_bytes > target.memory[0] and not target.planning:
        over = (f"memory plan: about {human_size(plan.peak_bytes)} per rank at its peak ({plan.peak_at}), more than "
                f"the {human_size(target.memory[0])} of {target.memory[1]}")
        if target.host_memory:  # the host's memory is the device: past it the host swaps or the kernel kills one
            raise ConfigError(f"{over}; {LOWER_THE_PEAK} (`--dry-run` prints where it goes)")
        logger.warning("%s: the run may run out of memory; `scripts/train.py --config ... --dry-run` prints where it "
                       "goes", over)
    # A dry run names the shards that are not on this machine instead of refusing them (the run checks them).
    unchecked = tuple(absent_shards(cfg)) if target.planning else ()
    source, validation = (None, None) if unchecked else resolve_data(cfg, vocab_size=args.vocab_size, dp=pd.dp)
    tasks = () if unchecked else resolve_tasks(cfg, vocab_size=args.vocab_size)
    files = run_file_texts(cfg, run_cfg=given, args=args, pd=pd, build=build, pipeline=pipeline,
                           float8_layers=float8_layers)
    options = resolve_options(cfg, bf16_master=build.fsdp.master_dtype == torch.bfloat16, device=target.device_type)
    if shape:  # the flavor the checkpoint records ("imported", or its run's), for the log and the next checkpoints
        options["run"] = dataclasses.replace(options["run"], flavor=shape.flavor)
    return ResolvedJob(parallel_dims=pd, model_args=args, build=build, data_source=source, tasks=tasks,
                       validation_source=validation, pipeline=pipeline, float8_layers=float8_layers, run_files=files,
                       memory_plan=plan, unchecked_data=unchecked, model_source=shape.line if shape else None,
                       fsdp_choices=describe_fsdp_choices(cfg, pd, build, ranks_per_node=target.ranks_per_node),
                       batch_warmup=batch_warmup, **options)


def _auto_dispatch(cfg: JobConfig, args: ModelArgs, pd: ParallelDims, build: BuildOptions, plan: MemoryPlan,
                   target: Target, plan_with: Callable[[BuildOptions], MemoryPlan]) -> tuple[BuildOptions, MemoryPlan]:
    """moe.dispatch='auto' at ep > 1: the padded all-to-all where it was measured faster (ep=PADDED_EP on GPUs, bf16
    dispatch, no token dropping) and the plan with it (`plan_with(build)`) stays within GATHERED_FITS of the device;
    the sized one otherwise. The build carries the choice and its reason for the expert-parallel startup line."""
    if pd.ep != PADDED_EP:
        why = f"ep={pd.ep}: padded moves ep x the rows and was measured faster only at ep={PADDED_EP}"
    elif target.device_type != "cuda":
        why = "not on GPUs, where padded saves one host sync per MoE layer"
    elif cfg.moe.dispatch_dtype == "fp8":
        why = "moe.dispatch_dtype='fp8' sizes its blocks on the host"
    elif args.capacity_factor > 0:
        why = f"moe.capacity_factor={args.capacity_factor}: token dropping reads the kept rows on the host"
    elif target.memory is None:
        why = "the device's memory is unknown"
    else:
        padded = dataclasses.replace(build, moe_padded_dispatch=True)
        padded_plan, bound = plan_with(padded), GATHERED_FITS * target.memory[0]
        sizes = (f"its memory plan {human_size(padded_plan.peak_bytes)} (sized: {human_size(plan.peak_bytes)}) "
                 f"against {human_size(bound)}, {GATHERED_FITS:.0%} of {target.memory[1]}")
        if padded_plan.peak_bytes <= bound:
            note = f"moe.dispatch='auto': padded at ep={PADDED_EP}, {sizes}"
            return dataclasses.replace(padded, moe_dispatch_note=note), padded_plan
        why = f"padded does not fit: {sizes}"
    return dataclasses.replace(build, moe_dispatch_note=f"moe.dispatch='auto': sized, {why}"), plan


def with_config(job: ResolvedJob, cfg: JobConfig, *, run_cfg: JobConfig, stop_step: int = 0) -> ResolvedJob:
    """`job` with the options and run files of `cfg` (its checks done, its model, layout and data those `job`
    resolved): a train.precision_schedule phase's config, whose run files name the whole run's `run_cfg` as
    config.toml. stop_step: 0 stops at train.steps."""
    options = resolve_options(cfg, bf16_master=job.build.fsdp.master_dtype == torch.bfloat16, stop_step=stop_step)
    options["run"] = dataclasses.replace(options["run"], flavor=job.run.flavor)  # a checkpoint's, where it gave one
    files = run_file_texts(cfg, run_cfg=run_cfg, args=job.model_args, pd=job.parallel_dims, build=job.build,
                           pipeline=job.pipeline, float8_layers=job.float8_layers)
    return dataclasses.replace(job, run_files=files, **options)


__all__ = ["ResolvedJob", "validate_job", "with_config"]
