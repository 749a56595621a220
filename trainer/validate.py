"""One validation pass: everything knowable from the config, the world size and the model arguments.

`check_config` holds the checks that need only the config (JobConfig runs it when
built, so a bad TOML or override fails while parsing). `validate_job` adds what needs
the world size, the model's shapes and the data's headers, and resolves the options
every later stage takes. Both raise `ConfigError` (or `DataError` for data files) with
one line naming the key, and run on every rank before `init_distributed` does any work.
Lower layers assert these facts; they do not check them again.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from trainer.config import JobConfig
    from trainer.models import ModelArgs
    from trainer.parallel import BuildOptions, ParallelDims
    from trainer.parallel.pipeline import PipelineOptions


def check_config(cfg: JobConfig) -> None:
    """Cross-field and range checks on the config alone; each failure is one line naming the key."""
    t, d = cfg.train, cfg.distributed
    if t.is_fp8 and d.tp > 1 and not t.precision_schedule:  # a schedule overrides mixed_precision
        raise ConfigError(
            "FP8 + Tensor Parallelism is not yet supported: train.mixed_precision='fp8' with "
            f"distributed.tp={d.tp}. Use distributed.tp=1 with FSDP (dp_shard) for FP8, "
            "or keep tp and set train.mixed_precision='bf16'."
        )
    if t.precision_schedule:
        _check_precision_schedule(cfg)
    at_least_one = {
        "train.steps": t.steps,
        "train.batch_size": t.batch_size,
        "train.seq_len": t.seq_len,
        "train.grad_accum_steps": t.grad_accum_steps,
        "metrics.log_freq": cfg.metrics.log_freq,
        "checkpoint.interval": cfg.checkpoint.interval,
        "distributed.dp_replicate": d.dp_replicate,
        "distributed.tp": d.tp,
        "distributed.ep": d.ep,
        "distributed.pp": d.pp,
        "distributed.pp_microbatch_size": d.pp_microbatch_size,
        "distributed.init_timeout_seconds": d.init_timeout_seconds,
    }
    for key, value in at_least_one.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    at_least_zero = {
        "model.n_layers": (cfg.model.n_layers, " (0 = the flavor's own)"),
        "model.vocab_size": (cfg.model.vocab_size, " (0 = the flavor's own)"),
        "train.max_norm": (t.max_norm, " (0 disables clipping)"),
        "train.selective_ac_every": (t.selective_ac_every, ""),
        "train.loss_chunk_tokens": (t.loss_chunk_tokens, " (0 = off)"),
        "scheduler.warmup_steps": (cfg.scheduler.warmup_steps, ""),
        "checkpoint.keep_latest_k": (cfg.checkpoint.keep_latest_k, " (0 keeps all)"),
        "metrics.fp8_stats_freq": (cfg.metrics.fp8_stats_freq, " (0 = off)"),
        "optimizer.weight_decay": (cfg.optimizer.weight_decay, ""),
        "distributed.pp_stages_per_rank": (d.pp_stages_per_rank, " (0 = automatic)"),
        "distributed.pp_layers_per_stage": (d.pp_layers_per_stage, " (0 = automatic)"),
        "distributed.pp_embedding_weight": (d.pp_embedding_weight, ""),
        "distributed.pp_head_weight": (d.pp_head_weight, ""),
    }
    for key, (value, note) in at_least_zero.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0{note}")
    if t.loss_chunk_tokens and d.tp > 1:
        raise ConfigError(
            f"train.loss_chunk_tokens={t.loss_chunk_tokens} with distributed.tp={d.tp}: a chunked loss is not "
            "implemented under tensor parallel (loss_parallel already splits the logits over the tp ranks); "
            "set train.loss_chunk_tokens=0"
        )
    if t.loss_chunk_tokens and d.pp > 1:
        raise ConfigError(
            f"train.loss_chunk_tokens={t.loss_chunk_tokens} with distributed.pp={d.pp}: the pipeline's last stage "
            "computes the loss on whole microbatch logits, unchunked; set train.loss_chunk_tokens=0 (a smaller "
            "distributed.pp_microbatch_size makes those logits smaller)"
        )
    if d.dp_shard == 0 or d.dp_shard < -1:
        raise ConfigError(f"distributed.dp_shard={d.dp_shard} must be >= 1, or -1 for the rest of the world size")
    _check_moe_section(cfg)
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be > 0")
    for key, value in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key}={value} must be in [0, 1)")
    if o.eps <= 0:
        raise ConfigError(f"optimizer.eps={o.eps} must be > 0")
    s = cfg.scheduler
    if not 0 <= s.min_lr_ratio <= 1:
        raise ConfigError(f"scheduler.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    if not 0 < s.wsd_decay_ratio <= 1:
        raise ConfigError(f"scheduler.wsd_decay_ratio={s.wsd_decay_ratio} must be in (0, 1]")
    if cfg.metrics.loss_spike_factor <= 1:
        raise ConfigError(f"metrics.loss_spike_factor={cfg.metrics.loss_spike_factor} must be > 1")
    c = cfg.checkpoint
    if c.load_step < -1:
        raise ConfigError(f"checkpoint.load_step={c.load_step} must be >= 0, or -1 for the latest")
    if c.load_step >= 0 and not c.enable:
        raise ConfigError(f"checkpoint.load_step={c.load_step} needs checkpoint.enable=true")
    if d.master_dtype == "bf16" and t.mixed_precision == "fp32":
        raise ConfigError(
            "distributed.master_dtype='bf16' computes with the bf16 weights, so train.mixed_precision='fp32' "
            "would not hold; set train.mixed_precision='bf16' (or 'fp8'), or keep distributed.master_dtype='fp32'"
        )
    f8 = cfg.float8
    if f8.enable_fsdp_float8_all_gather is True and f8.recipe != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather=true only works with float8.recipe='tensorwise' "
            f"(got recipe='{f8.recipe}'); set --float8.enable_fsdp_float8_all_gather=auto (or false)"
        )
    p = cfg.profiling
    if p.enable and not 1 <= p.start_step <= p.end_step:
        raise ConfigError(
            f"profiling.start_step={p.start_step}, profiling.end_step={p.end_step}: the window must satisfy "
            "1 <= start_step <= end_step"
        )
    v = cfg.validation
    if v.enable:
        for key, value in (("validation.freq", v.freq), ("validation.steps", v.steps)):
            if value < 1:
                raise ConfigError(f"{key}={value} must be >= 1")
        if cfg.data.source == "shards" and not v.path:
            raise ConfigError("validation.enable=true with data.source='shards' needs validation.path: held-out "
                              "shards made by scripts/prepare_data.py with the same tokenizer")
    if cfg.data.source == "shards" and not cfg.data.path:
        raise ConfigError("data.source='shards' needs data.path: a folder of .bin shards made by scripts/prepare_data.py")
    if cfg.data.source in ("default", "stdlib") and cfg.data.tokenizer != "byte":
        raise ConfigError(
            f"data.source='{cfg.data.source}' is byte-tokenized but data.tokenizer='{cfg.data.tokenizer}'; "
            "set data.source='shards' (with data.path) to read shards made with that tokenizer"
        )


def _check_moe_section(cfg: JobConfig) -> None:
    moe = cfg.moe
    if moe.top_k < 0:
        raise ConfigError(f"moe.top_k={moe.top_k} must be >= 1, or 0 for the flavor's own")
    if moe.capacity_factor < 0:
        raise ConfigError(f"moe.capacity_factor={moe.capacity_factor} must be >= 0 (0 = no token dropping)")
    for key, value in (("moe.aux_loss_coef", moe.aux_loss_coef), ("moe.bias_update_rate", moe.bias_update_rate)):
        if value < 0 and value != -1:
            raise ConfigError(f"{key}={value} must be >= 0 (0 = off), or -1 for the flavor's own")


def _moe_overrides(cfg: JobConfig) -> dict[str, Any]:
    """The [moe] keys that replace the flavor's values."""
    moe = cfg.moe
    out: dict[str, Any] = {"capacity_factor": moe.capacity_factor}
    if moe.top_k:
        out["top_k"] = moe.top_k
    if moe.aux_loss_coef != -1:
        out["aux_loss_coef"] = moe.aux_loss_coef
    if moe.bias_update_rate != -1:
        out["bias_update_rate"] = moe.bias_update_rate
    return out


def _check_moe_job(cfg: JobConfig, args: Any, pd: ParallelDims) -> None:
    """MoE-only checks that need the flavor's shapes and the resolved degrees."""
    from trainer.config import MoESection
    from trainer.models import is_moe

    m = cfg.model
    if not is_moe(args):
        if pd.ep > 1:
            raise ConfigError(
                f"distributed.ep={pd.ep} needs an MoE model, but model.flavor={m.flavor!r} is dense; "
                "set distributed.ep=1 or an MoE flavor (debug_moe, moe_small, moe_16b)"
            )
        changed = [f for f in MoESection.__dataclass_fields__ if getattr(cfg.moe, f) != getattr(MoESection(), f)]
        if changed:
            raise ConfigError(
                f"moe.{changed[0]}={getattr(cfg.moe, changed[0])} has no effect: model.flavor={m.flavor!r} is dense; "
                "remove it or pick an MoE flavor"
            )
        return
    if args.top_k > args.n_experts:
        raise ConfigError(
            f"moe.top_k={args.top_k} is more than the {args.n_experts} routed experts of model.flavor={m.flavor!r}"
        )
    if pd.ep > 1 and args.n_experts % pd.ep:
        raise ConfigError(
            f"distributed.ep={pd.ep} must divide the {args.n_experts} routed experts of model.flavor={m.flavor!r}"
        )
    if pd.tp > 1:
        raise ConfigError(
            f"distributed.tp={pd.tp} with the MoE flavor {m.flavor!r}: tensor parallel MoE blocks are not "
            "implemented; set distributed.tp=1 and use distributed.ep (and dp_shard) instead"
        )
    t = cfg.train
    if pd.ep > 1 and t.activation_checkpointing == "selective" and t.selective_ac_every == 0:
        # The experts' own FSDP2 unit runs different hooks in the recompute than in the forward,
        # which the per-op policy's bookkeeping rejects during backward.
        raise ConfigError(
            f"train.activation_checkpointing='selective' with the per-op policy (train.selective_ac_every=0) does not "
            f"work with distributed.ep={pd.ep}; set train.selective_ac_every=N (full AC every Nth block) or "
            "train.activation_checkpointing='full'"
        )
    if cfg.checkpoint.model_only:
        raise ConfigError(
            f"checkpoint.model_only=true exports Hugging Face Llama weights, which model.flavor={m.flavor!r} "
            "(MoE) has no layout for; set checkpoint.model_only=false"
        )


def _check_precision_schedule(cfg: JobConfig) -> None:
    from trainer.precision_schedule import parse_precision_schedule

    t = cfg.train
    if t.steps < 1:
        return  # reported below as train.steps
    phases = parse_precision_schedule(t.precision_schedule, total_steps=t.steps)
    fp8 = [p for p in phases if p.precision == "fp8"]
    if fp8 and cfg.distributed.tp > 1:
        raise ConfigError(
            f"train.precision_schedule has an fp8 phase ({fp8[0]}) but distributed.tp={cfg.distributed.tp}: FP8 + "
            "Tensor Parallelism is not yet supported; use distributed.tp=1 with FSDP (dp_shard), or no fp8 phase"
        )
    if not cfg.checkpoint.enable:
        raise ConfigError(
            "train.precision_schedule needs checkpoint.enable=true: each precision switch saves a checkpoint and the "
            "next phase resumes it (and a relaunch resumes the right phase); set --checkpoint.enable=true"
        )
    p = cfg.profiling
    if p.enable:
        for a, b in zip(phases, phases[1:]):
            if p.start_step <= a.last_step < p.end_step:
                raise ConfigError(
                    f"profiling.start_step={p.start_step}, profiling.end_step={p.end_step}: the window crosses the "
                    f"train.precision_schedule switch {a.precision} -> {b.precision} after step {a.last_step}; "
                    "put it inside one phase"
                )


@dataclass(frozen=True)
class ResolvedJob:
    """What validation resolved, handed to the trainer so nothing is worked out twice."""

    parallel_dims: ParallelDims
    model_args: ModelArgs
    build: BuildOptions
    data_source: Any
    """The opened, checked sample source (trainer.data.sources)."""
    validation_source: Any = None
    """The held-out source when validation.enable (never overlaps data_source)."""
    pipeline: PipelineOptions | None = None
    """The stage layout and schedule when distributed.pp > 1."""


_COMPUTE_DTYPE = {"fp32": None, "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}


def validate_job(cfg: JobConfig, *, world_size: int) -> ResolvedJob:
    """Check everything that needs the world size, the model's shapes or the data; resolve the build options."""
    import torch

    from trainer.data.loader import build_source
    from trainer.models import FLAVORS, build_model, is_moe, model_args_for
    from trainer.parallel import ACOptions, BuildOptions, Float8Options, FSDPOptions, ParallelDims
    from trainer.parallel.float8 import select_float8_linears

    t, d, m = cfg.train, cfg.distributed, cfg.model
    if d.pp > 1 and world_size % d.pp:
        raise ConfigError(f"distributed.pp={d.pp} does not divide the world size {world_size}")
    pd = ParallelDims.resolve(
        dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, tp=d.tp, ep=d.ep, pp=d.pp, world_size=world_size
    )

    if m.flavor not in FLAVORS:
        raise ConfigError(f"model.flavor={m.flavor!r} is not one of {', '.join(repr(f) for f in FLAVORS)}")
    moe = _moe_overrides(cfg) if is_moe(FLAVORS[m.flavor]) else {}
    args = model_args_for(m.flavor, vocab_size=m.vocab_size, n_layers=m.n_layers, max_seq_len=t.seq_len, **moe)
    if t.seq_len > FLAVORS[m.flavor].max_seq_len:
        # Allowed (long-context training), never silent: the position table grows past the flavor's.
        logger.warning(
            "train.seq_len=%d is longer than model.flavor=%r's max_seq_len=%d: the RoPE table is extended to %d "
            "positions", t.seq_len, m.flavor, FLAVORS[m.flavor].max_seq_len, t.seq_len,
        )
    if args.n_heads % pd.tp or args.n_kv_heads % pd.tp:
        raise ConfigError(
            f"distributed.tp={pd.tp} must divide the model's n_heads={args.n_heads} and n_kv_heads={args.n_kv_heads} "
            f"(model.flavor={m.flavor!r})"
        )
    _check_moe_job(cfg, args, pd)
    if pd.pp > 1 and getattr(args, "n_experts", 0):
        raise ConfigError(f"distributed.pp={pd.pp} with the MoE flavor {m.flavor!r}: pipeline parallelism of MoE "
                          "models is not implemented yet; use distributed.ep and dp_shard, or a dense flavor")
    pipeline = _resolve_pipeline(cfg, pp=pd.pp, n_layers=args.n_layers)

    float8 = None
    if t.is_fp8:
        f8 = cfg.float8
        all_gather = f8.enable_fsdp_float8_all_gather
        if all_gather == "auto":
            all_gather = f8.recipe == "tensorwise" and pd.dp_shard > 1
        float8 = Float8Options(recipe=f8.recipe, enable_fsdp_float8_all_gather=all_gather,
                               exclude_fqns=tuple(f8.exclude_fqns), emulate=f8.emulate, require=f8.require)
        with torch.device("meta"):
            shapes = build_model(args)
        try:
            select_float8_linears(shapes, exclude_fqns=list(f8.exclude_fqns))
        except ValueError as e:  # an exclude_fqns entry that matches nothing
            raise ConfigError(str(e)) from None
        _check_fp8_hardware(require=f8.require, emulate=f8.emulate)

    if d.master_dtype == "bf16" and cfg.optimizer.bf16_update == "nearest":
        logger.warning(
            "distributed.master_dtype='bf16' with optimizer.bf16_update='nearest': plain AdamW on bf16 weights "
            "LOSES every update below half a bf16 ulp (~0.2%% of the weight), so small-lr/late-training updates "
            "vanish; use optimizer.bf16_update='stochastic' or 'kahan'"
        )
    dtype = _COMPUTE_DTYPE[t.mixed_precision]
    # Resharding frees the gathered copy between forward and backward; with one rank
    # per shard group it frees nothing but still costs a second gather in backward.
    # Under PP every microbatch runs forward and backward through each stage: resharding would
    # all-gather the weights again for each of them, so the default keeps them (ZeRO-2 style).
    reshard = d.reshard_after_forward == "always" or (
        d.reshard_after_forward == "default" and pd.dp_shard > 1 and pd.pp == 1
    )
    build = BuildOptions(
        float8=float8,
        ac=ACOptions(mode=t.activation_checkpointing, selective_every=t.selective_ac_every),
        compile=t.compile_model,
        fsdp=FSDPOptions(
            param_dtype=getattr(torch, dtype) if dtype else None, reduce_dtype=torch.float32,
            master_dtype=torch.bfloat16 if d.master_dtype == "bf16" else torch.float32,
            reshard_after_forward=reshard,
        ),
        loss_parallel=d.loss_parallel,
        loss_chunk_tokens=t.loss_chunk_tokens,
    )
    tokens = t.batch_size * t.seq_len
    if t.loss_chunk_tokens >= tokens:
        logger.warning(
            "train.loss_chunk_tokens=%d >= the %d tokens of a microbatch (train.batch_size x train.seq_len): one "
            "chunk, so no memory is saved but the output head still runs again in backward; lower it",
            t.loss_chunk_tokens, tokens,
        )
    data = cfg.data
    source = build_source(source=data.source, path=data.path, tokenizer=data.tokenizer, seed=data.seed,
                          vocab_size=args.vocab_size, seq_len=t.seq_len)
    if cfg.validation.enable and pd.pp > 1 and d.pipeline_schedule == "ZBVZeroBubble":
        raise ConfigError(
            "validation.enable=true with distributed.pipeline_schedule='ZBVZeroBubble': torch's forward-only "
            "schedule.eval() cannot run the V-shaped zero-bubble schedule (it fails at the first evaluation); use "
            "another schedule (e.g. InterleavedZeroBubble) or validation.enable=false"
        )
    validation = _validation_source(cfg, vocab_size=args.vocab_size, dp=pd.dp) if cfg.validation.enable else None
    return ResolvedJob(parallel_dims=pd, model_args=args, build=build, data_source=source,
                       validation_source=validation, pipeline=pipeline)


def _validation_source(cfg: JobConfig, *, vocab_size: int, dp: int):
    from trainer.data.loader import build_source

    v, data, t = cfg.validation, cfg.data, cfg.train
    if v.path:
        source = build_source(source="shards", path=v.path, tokenizer=data.tokenizer, seed=data.seed,
                              vocab_size=vocab_size, seq_len=t.seq_len, path_key="validation.path")
    else:
        source = build_source(source=data.source, path=data.path, tokenizer=data.tokenizer, seed=data.seed,
                              vocab_size=vocab_size, seq_len=t.seq_len, split="validation")
    needed, have = v.steps * t.batch_size * dp, source.num_samples(t.seq_len)
    if needed > have:
        raise ConfigError(
            f"validation.steps={v.steps} x train.batch_size={t.batch_size} x {dp} data-parallel ranks needs {needed} "
            f"held-out samples of seq_len {t.seq_len}, but {source!r} has {have}; lower validation.steps"
            + ("" if v.path else " or set validation.path to held-out shards")
        )
    return source


_PP_KEYS = ("pp_split_points", "pp_layers_per_stage", "pp_stages_per_rank")


def _resolve_pipeline(cfg: JobConfig, *, pp: int, n_layers: int) -> PipelineOptions | None:
    """The stage layout and schedule of distributed.pp > 1; None for pp=1 (where the pp_* keys must be unset)."""
    from trainer.parallel.pipeline import (
        SINGLE_STAGE_SCHEDULES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, PipelineOptions, default_stages_per_rank, even_split,
        parse_split_point, split_at, stage_module_fqns,
    )

    d, t = cfg.distributed, cfg.train
    if pp == 1:
        for key in _PP_KEYS:
            if getattr(d, key):
                raise ConfigError(f"distributed.{key}={getattr(d, key)!r} is set but distributed.pp=1: "
                                  "set distributed.pp > 1 for pipeline parallelism, or remove it")
        return None
    schedule = d.pipeline_schedule
    if t.batch_size % d.pp_microbatch_size:
        raise ConfigError(
            f"distributed.pp_microbatch_size={d.pp_microbatch_size} does not divide train.batch_size={t.batch_size} "
            "(the batch of each data-parallel rank is cut into pipeline microbatches of this size)"
        )
    num_microbatches = t.batch_size // d.pp_microbatch_size
    if schedule in ZERO_BUBBLE_SCHEDULES:
        # Zero-bubble schedules run each stage's backward in two passes (input grads, then weight grads).
        if t.compile_model:
            raise ConfigError(
                f"distributed.pipeline_schedule={schedule!r} with train.compile_model=true: torch's zero-bubble "
                "schedules cannot split the backward of compiled blocks; use 'Interleaved1F1B' or compile_model=false"
            )
        if t.activation_checkpointing == "selective" and t.selective_ac_every == 0:
            raise ConfigError(
                f"distributed.pipeline_schedule={schedule!r} with train.activation_checkpointing='selective' "
                "(per-op policy): a selectively checkpointed region cannot run its backward in two passes; use "
                "activation_checkpointing='full', selective_ac_every > 0, or the 'Interleaved1F1B' schedule"
            )
    if d.pp_split_points and d.pp_layers_per_stage:
        raise ConfigError("distributed.pp_split_points and distributed.pp_layers_per_stage both set: give one")

    # How many stages: explicit split points, a layers-per-stage budget, or pp x stages per rank.
    total = n_layers + d.pp_embedding_weight + d.pp_head_weight
    if d.pp_split_points:
        firsts = []
        for entry in d.pp_split_points:
            block = parse_split_point(entry)
            if block is None or block >= n_layers:
                raise ConfigError(
                    f"distributed.pp_split_points entry {entry!r} names no module: split points are "
                    f"'layers.N' blocks, layers.0..layers.{n_layers - 1} in this model"
                )
            firsts.append(block)
        if any(a >= b for a, b in zip(firsts, firsts[1:])):
            raise ConfigError(f"distributed.pp_split_points={d.pp_split_points} must be in increasing block order")
        num_stages, key = len(firsts) + 1, "distributed.pp_split_points"
    elif d.pp_layers_per_stage:
        num_stages, key = math.ceil(total / d.pp_layers_per_stage), "distributed.pp_layers_per_stage"
    else:
        num_stages = pp * (d.pp_stages_per_rank or default_stages_per_rank(schedule))
        key = "distributed.pp_stages_per_rank" if d.pp_stages_per_rank else "distributed.pp"
    if num_stages > total:
        raise ConfigError(
            f"{key}: {num_stages} pipeline stages but the model has only {n_layers} blocks (+ embedding and head = "
            f"{total} layer-equivalents); lower distributed.pp or distributed.pp_stages_per_rank"
        )
    if num_stages % pp:
        raise ConfigError(f"{key} gives {num_stages} pipeline stages, not a multiple of distributed.pp={pp}")
    per_rank = num_stages // pp
    if d.pp_stages_per_rank and d.pp_stages_per_rank != per_rank:
        raise ConfigError(f"distributed.pp_stages_per_rank={d.pp_stages_per_rank} but {key} gives {per_rank} "
                          f"stages per rank ({num_stages} stages over pp={pp})")
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ConfigError(
            f"distributed.pipeline_schedule={schedule!r} runs one stage per rank, but {key} gives {per_rank}; "
            "use 'Interleaved1F1B' for several stages per rank"
        )
    if schedule not in SINGLE_STAGE_SCHEDULES and per_rank < 2:
        raise ConfigError(
            f"distributed.pipeline_schedule={schedule!r} needs at least 2 stages per rank, but {key} gives "
            f"{per_rank}; use '1F1B' for one stage per rank"
        )
    if schedule in V_SCHEDULES and per_rank != 2:
        raise ConfigError(f"distributed.pipeline_schedule={schedule!r} runs exactly 2 stages per rank (a V), "
                          f"but {key} gives {per_rank}")

    if d.pp_split_points:
        counts = split_at(n_layers, firsts)
    else:
        try:
            counts = even_split(n_layers, num_stages, embedding_weight=d.pp_embedding_weight,
                                head_weight=d.pp_head_weight)
        except ValueError as e:
            raise ConfigError(
                f"distributed.pp_embedding_weight={d.pp_embedding_weight}, distributed.pp_head_weight="
                f"{d.pp_head_weight}: no even split of {n_layers} blocks into {num_stages} stages ({e}); "
                "lower the weights"
            ) from None
    if num_microbatches < pp:
        logger.warning(
            "pipeline: %d microbatches (train.batch_size=%d / distributed.pp_microbatch_size=%d) for pp=%d: "
            "most ranks idle most of the step; use at least pp (better 2-4x pp) microbatches",
            num_microbatches, t.batch_size, d.pp_microbatch_size, pp,
        )
    return PipelineOptions(schedule=schedule, microbatch_size=d.pp_microbatch_size,
                           num_microbatches=num_microbatches, stages_per_rank=per_rank,
                           stage_fqns=stage_module_fqns(counts))


def _check_fp8_hardware(*, require: bool, emulate: bool) -> None:
    """float8.require on a GPU without FP8 tensor cores fails here, before any process group exists."""
    import torch

    if emulate or not require or not torch.cuda.is_available():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    major, minor = torch.cuda.get_device_capability(local_rank)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"train.mixed_precision='fp8' with float8.require=true, but {torch.cuda.get_device_name(local_rank)} "
            f"(compute capability {major}.{minor}) has no FP8 tensor cores (needs >= 8.9); "
            "use bf16 or a Hopper/Ada GPU"
        )
