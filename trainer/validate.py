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
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from trainer.config import JobConfig
    from trainer.models import ModelArgs
    from trainer.parallel import BuildOptions, ParallelDims


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
        "scheduler.warmup_steps": (cfg.scheduler.warmup_steps, ""),
        "checkpoint.keep_latest_k": (cfg.checkpoint.keep_latest_k, " (0 keeps all)"),
        "metrics.fp8_stats_freq": (cfg.metrics.fp8_stats_freq, " (0 = off)"),
        "optimizer.weight_decay": (cfg.optimizer.weight_decay, ""),
    }
    for key, (value, note) in at_least_zero.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0{note}")
    if d.dp_shard == 0 or d.dp_shard < -1:
        raise ConfigError(f"distributed.dp_shard={d.dp_shard} must be >= 1, or -1 for the rest of the world size")
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
    f8 = cfg.float8
    if f8.enable_fsdp_float8_all_gather and f8.recipe != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather=true only works with float8.recipe='tensorwise' "
            f"(got recipe='{f8.recipe}'); set --float8.enable_fsdp_float8_all_gather=false"
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


_COMPUTE_DTYPE = {"fp32": None, "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}


def validate_job(cfg: JobConfig, *, world_size: int) -> ResolvedJob:
    """Check everything that needs the world size, the model's shapes or the data; resolve the build options."""
    import torch

    from trainer.data.loader import build_source
    from trainer.models import FLAVORS, Llama, model_args_for
    from trainer.parallel import ACOptions, BuildOptions, Float8Options, FSDPOptions, ParallelDims
    from trainer.parallel.float8 import select_float8_linears

    t, d, m = cfg.train, cfg.distributed, cfg.model
    pd = ParallelDims.resolve(
        dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, tp=d.tp, ep=d.ep, pp=d.pp, world_size=world_size
    )
    if pd.pp > 1:
        raise ConfigError(f"distributed.pp={pd.pp}: pipeline parallelism is not implemented yet; set it to 1")

    if m.flavor not in FLAVORS:
        raise ConfigError(f"model.flavor={m.flavor!r} is not one of {', '.join(repr(f) for f in FLAVORS)}")
    args = model_args_for(m.flavor, vocab_size=m.vocab_size, n_layers=m.n_layers, max_seq_len=t.seq_len)
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
    n_experts = getattr(args, "n_experts", 0)
    if pd.ep > 1 and not n_experts:
        raise ConfigError(
            f"distributed.ep={pd.ep} needs an MoE model, but model.flavor={m.flavor!r} is dense; set distributed.ep=1"
        )
    if pd.ep > 1 and n_experts % pd.ep:
        raise ConfigError(f"distributed.ep={pd.ep} must divide the model's {n_experts} routed experts")

    float8 = None
    if t.is_fp8:
        f8 = cfg.float8
        float8 = Float8Options(recipe=f8.recipe, enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
                               exclude_fqns=tuple(f8.exclude_fqns), emulate=f8.emulate, require=f8.require)
        with torch.device("meta"):
            shapes = Llama(args)
        try:
            select_float8_linears(shapes, exclude_fqns=list(f8.exclude_fqns))
        except ValueError as e:  # an exclude_fqns entry that matches nothing
            raise ConfigError(str(e)) from None
        _check_fp8_hardware(require=f8.require, emulate=f8.emulate)

    dtype = _COMPUTE_DTYPE[t.mixed_precision]
    # Resharding frees the gathered copy between forward and backward; with one rank
    # per shard group it frees nothing but still costs a second gather in backward.
    reshard = d.reshard_after_forward == "always" or (d.reshard_after_forward == "default" and pd.dp_shard > 1)
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
    )
    data = cfg.data
    source = build_source(source=data.source, path=data.path, tokenizer=data.tokenizer, seed=data.seed,
                          vocab_size=args.vocab_size, seq_len=t.seq_len)
    validation = _validation_source(cfg, vocab_size=args.vocab_size, dp=pd.dp) if cfg.validation.enable else None
    return ResolvedJob(parallel_dims=pd, model_args=args, build=build, data_source=source,
                       validation_source=validation)


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
