"""`scripts/train.py --config ... --dry-run [--world-size N] [--gpu-memory-gib G]`: plan a job without running it.

The whole validation pass for N ranks (trainer.validate.validate_job, as each rank of the real run does it,
planned for CUDA GPUs with FP8 tensor cores and G GiB each), then what it resolved: the layout, the model,
the precision, the batch, the data, and the per-GPU memory plan (trainer.validate.plan). No GPU, no process
group, no folder is touched; data files that are not on this machine are named, not refused. A config the
real run would refuse gives the same one-line error.

The last line is the verdict: `OK: ...` (exit 0) only when the planned peak fits the GPU, else `DOES NOT FIT: ...`
and exit 3 (EXIT_DOES_NOT_FIT), so a script that books GPUs can read the exit status (2: a config error).
"""

from __future__ import annotations

from trainer.checkpoint.format import EXPORT_DTYPES
from trainer.config import JobConfig
from trainer.hf import export_bytes
from trainer.models.counts import num_params_for
from trainer.models import family_of
from trainer.validate import ResolvedJob, validate_job
from trainer.validate.memory import planned_gpus
from trainer.validate.plan import LOWER_THE_PEAK, human_size
from trainer.validate.run_files import describe_documents, describe_precision

# torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3 (79.2 GiB); an H200 has 139.8.
DEFAULT_GPU_GIB = 79.2

# The exit status of a dry run whose plan does not fit the GPU (0: it fits; 2: a config error).
EXIT_DOES_NOT_FIT = 3


def dry_run(cfg: JobConfig, *, world_size: int, gpu_gib: float = DEFAULT_GPU_GIB) -> tuple[str, bool]:
    """(the plan of `cfg` on `world_size` GPUs of `gpu_gib` GiB, whether it fits); raises what the real run's
    validation raises."""
    target = planned_gpus(gpu_gib)
    job = validate_job(cfg, world_size=world_size, target=target)
    return describe_plan(job, cfg, target_memory=target.memory), job.memory_plan.fits(target.memory)


def describe_plan(job: ResolvedJob, cfg: JobConfig, *, target_memory: tuple[int, str] | None) -> str:
    args, pd, run, plan = job.model_args, job.parallel_dims, job.run, job.memory_plan
    total, non_embedding = num_params_for(args)
    lines = [
        f"dry run for {pd.world_size} rank{'s' if pd.world_size > 1 else ''}: nothing was started",
        f"layout: {pd.summary}" + (f"; pipeline {job.pipeline.schedule}, {job.pipeline.num_stages} stages, "
                                   f"{job.pipeline.num_microbatches} microbatches" if job.pipeline else ""),
        f"model: {run.flavor}, {total:,} parameters ({non_embedding:,} non-embedding), dim={args.dim}, "
        f"layers={args.n_layers}, heads={args.n_heads}/{args.n_kv_heads} kv x {args.head_dim}, ffn={args.ffn_dim}, "
        f"vocab={args.vocab_size}",
    ]
    if job.model_source:  # the shape is checkpoint.initial_load_path's
        lines.append(job.model_source)
    if (family_line := family_of(args).describe(args)) is not None:  # MoE: active parameters, routing
        lines.append(family_line)
    lines.append(describe_precision(mixed_precision=run.mixed_precision, bf16_update=job.optimizer.bf16_update,
                                    build=job.build, float8_layers=job.float8_layers))
    if job.fsdp_choices:
        lines.append(job.fsdp_choices)
    lines.append(f"activation checkpointing: {job.build.ac.mode}; compile: {'on' if job.build.compile else 'off'}")
    tokens = run.batch_size * run.seq_len * run.grad_accum_steps * pd.dp
    lines.append(f"batch: {run.batch_size} sequences x {run.seq_len} tokens x {run.grad_accum_steps} accumulation "
                 f"step{'s' if run.grad_accum_steps > 1 else ''} x {pd.dp} data-parallel rank"
                 f"{'s' if pd.dp > 1 else ''} = {tokens:,} tokens per step, {run.steps:,} steps")
    if job.batch_warmup is not None and job.batch_warmup.tokens:  # the same microbatches: the plan below holds
        lines.append(job.batch_warmup.describe())
    if job.unchecked_data:
        lines.append(f"data: {', '.join(job.unchecked_data)} not on this machine: not checked (the run checks its "
                     "headers, tokenizer and size)")
    else:
        lines.append(f"data: {job.data_source!r}" + (f"; validation {job.validation_source!r}"
                                                     if job.validation_source is not None else ""))
    if documents := describe_documents(document_eos=job.build.document_eos, eod_mask_id=run.eod_mask_id):
        lines.append(documents)
    if c := cfg.checkpoint.export_interval:  # not the GPU's memory: the host's, on rank 0
        size = human_size(export_bytes(args, EXPORT_DTYPES[cfg.checkpoint.export_dtype]))
        lines.append(f"host memory: checkpoint.export_interval={c} gathers the whole model ({size} in "
                     f"{cfg.checkpoint.export_dtype}) into rank 0's host memory at each export, held while it is written")
    rank = f" (pipeline rank {plan.pp_rank}, the one that holds the most)" if pd.pp > 1 else ""
    lines.append(f"memory per GPU{rank}, estimated (docs/benchmarks.md holds it against measured peaks):")
    lines.append(plan.table(capacity=target_memory))
    if plan.fits(target_memory):
        lines.append(f"OK: {cfg.job.dump_folder} would train with this plan (`--dry-run` dropped, under torchrun with "
                     f"{pd.world_size} process{'es' if pd.world_size > 1 else ''})")
    else:
        cap, what = target_memory
        lines.append(f"DOES NOT FIT: {cfg.job.dump_folder} would need about {human_size(plan.peak_bytes)} per GPU, "
                     f"{human_size(plan.peak_bytes - cap)} more than {what}: {LOWER_THE_PEAK} (exit "
                     f"{EXIT_DOES_NOT_FIT})")
    return "\n".join(lines)
