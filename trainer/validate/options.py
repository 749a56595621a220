"""The typed options the Trainer runs from, resolved once from the checked config: nothing below train() reads it.

    RunOptions         steps, the step to stop at, batch shape, seeds, precision, clipping, the run's folder
    OptimizerOptions   AdamW's values, its state dtypes and rounding, and the implementation that runs them
    SchedulerOptions   the LR schedule
    MetricsOptions     log frequency and writers
    ValidationOptions  held-out evaluation (when validation.enable)
    ProfilingOptions   the profiler window and where traces go
    CheckpointOptions  (trainer.checkpoint.options) what the checkpoint manager needs

Each is a frozen dataclass with only what its reader uses; `resolve_options` makes them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.checkpoint.options import CheckpointOptions
from trainer.checkpoint.state import run_tokenizer
from trainer.config import CheckpointSection, JobConfig, OptimizerSection
from trainer.data.tokenizer import eos_id
from trainer.errors import ConfigError
from trainer.metrics.wandb_run import WandbOptions
from trainer.optim import resolve_implementation
from trainer.optim.adamw import Rounding, is_rounded
from trainer.optim.build import Implementation
from trainer.optim.states import StateDtypes


@dataclass(frozen=True)
class RunOptions:
    steps: int
    """train.steps: the whole run's (the LR schedule, the last log line, the final checkpoint)."""
    stop_step: int
    """The step this Trainer stops at and saves: `steps`, or earlier (the end of a train.precision_schedule phase)."""
    seed: int
    deterministic: bool
    batch_size: int
    seq_len: int
    grad_accum_steps: int
    mixed_precision: str
    compile_model: bool
    max_norm: float
    on_nonfinite: Literal["stop", "skip"]
    dump_folder: str
    init_timeout_seconds: int
    data_seed: int
    data_shuffle: bool
    flavor: str
    device_type: str
    """"cuda" where CUDA is available, else "cpu": what init_distributed picks, known before it runs."""
    tokenizer: dict[str, str]
    """RunInfo's tokenizer fields (trainer.checkpoint.run_tokenizer): none for synthetic tokens."""
    eod_mask_id: int | None = None
    """data.eod_mask_loss: the EOS id whose next token is not trained on (labels after it are IGNORE_INDEX)."""
    ema_decay: float = 0.0
    """train.ema_decay: 0 = no average of the weights (trainer/checkpoint/ema.py)."""


@dataclass(frozen=True)
class OptimizerOptions:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    implementation: Implementation
    """optimizer.implementation with 'auto' resolved for the device and the state (trainer.optim.resolve_implementation)."""
    state_dtypes: StateDtypes
    """The master weights' and moments' dtypes (distributed.master_dtype, optimizer.exp_avg_dtype / exp_avg_sq_dtype)."""
    bf16_update: Literal["stochastic", "kahan", "nearest"] | None
    """optimizer.bf16_update with bf16 master weights; None with fp32 ones."""

    @property
    def rounding(self) -> Rounding:
        """How the master weights take an update (trainer.optim.adamw.AdamW): fp32 ones are not rounded."""
        return self.bf16_update or "nearest"

    @property
    def fused(self) -> bool:
        """Clipping and the non-finite skip run inside the update (every implementation but foreach)."""
        return self.implementation != "foreach"


@dataclass(frozen=True)
class SchedulerOptions:
    warmup_steps: int
    decay_type: Literal["cosine", "linear", "wsd", "constant"]
    min_lr_ratio: float
    wsd_decay_ratio: float


@dataclass(frozen=True)
class MetricsOptions:
    log_freq: int
    enable_tensorboard: bool
    enable_jsonl: bool
    loss_spike_factor: float
    fp8_stats_freq: int
    event_log: bool
    """metrics.event_log: every rank writes events/rank-NNNNN.jsonl (trainer/metrics/events.py)."""
    kurtosis_warn: float = 0.0
    """metrics.kurtosis_warn: the FP8 stats' warning threshold of a block input's kurtosis (0 = none)."""
    wandb: WandbOptions | None = None
    """metrics.wandb: the W&B run's project, entity, name, group and tags."""


@dataclass(frozen=True)
class ValidationOptions:
    steps: int
    """Batches per evaluation."""
    freq: int
    """Steps between evaluations."""
    bf16_matmuls: bool = False
    """validation.mixed_precision='bf16': an fp8 model's matmuls run in bf16 while it evaluates."""


@dataclass(frozen=True)
class ProfilingOptions:
    enable: bool
    start_step: int
    end_step: int
    trace_dir: str
    """profiling.trace_dir, or the run's job.dump_folder/profiler_traces."""
    record_shapes: bool
    with_stack: bool
    profile_memory: bool
    memory_snapshot: bool
    expect_fp8: bool
    """An fp8 run on real FP8 kernels (not emulated): the trace summary looks for them."""


def device_type() -> str:
    """The device type init_distributed (trainer.distributed) will pick."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_options(cfg: JobConfig, *, bf16_master: bool, stop_step: int = 0, device: str = "") -> dict[str, Any]:
    """Every option object of a ResolvedJob but the build's, from the checked config (keyword -> object).

    stop_step: 0 stops at train.steps. device: the device type the job runs on ("" = this machine's)."""
    t, o, s, m, p = cfg.train, cfg.optimizer, cfg.scheduler, cfg.metrics, cfg.profiling
    device = device or device_type()
    if not 0 <= t.ema_decay < 1:
        raise ConfigError(f"train.ema_decay={t.ema_decay} must be in [0, 1): 0 turns the weights' EMA off, e.g. 0.999 "
                          "averages over about 1000 steps")
    run = RunOptions(
        steps=t.steps, stop_step=stop_step or t.steps, seed=t.seed, deterministic=t.deterministic,
        batch_size=t.batch_size, seq_len=t.seq_len, grad_accum_steps=t.grad_accum_steps,
        mixed_precision=t.mixed_precision, compile_model=t.compile_model, max_norm=t.max_norm,
        on_nonfinite=t.on_nonfinite, dump_folder=cfg.job.dump_folder,
        init_timeout_seconds=cfg.distributed.init_timeout_seconds, data_seed=cfg.data.seed,
        data_shuffle=cfg.data.shuffle, flavor=cfg.model.flavor, device_type=device,
        tokenizer=run_tokenizer(cfg.data.source, cfg.data.tokenizer),
        eod_mask_id=eos_id(cfg.data.tokenizer) if cfg.data.eod_mask_loss else None, ema_decay=t.ema_decay,
    )
    optimizer = resolve_optimizer(o, bf16_master=bf16_master, device=device)
    c, v = cfg.checkpoint, cfg.validation
    return dict(
        run=run, optimizer=optimizer,
        scheduler=SchedulerOptions(warmup_steps=s.warmup_steps, decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio,
                                   wsd_decay_ratio=s.wsd_decay_ratio),
        metrics=MetricsOptions(log_freq=m.log_freq, enable_tensorboard=m.enable_tensorboard,
                               enable_jsonl=m.enable_jsonl, loss_spike_factor=m.loss_spike_factor,
                               fp8_stats_freq=m.fp8_stats_freq, event_log=m.event_log, kurtosis_warn=m.kurtosis_warn,
                               wandb=WandbOptions(project=m.wandb_project, entity=m.wandb_entity,
                                                  run_name=m.wandb_run_name, group=m.wandb_group,
                                                  tags=tuple(m.wandb_tags)) if m.wandb else None),
        validation=(ValidationOptions(steps=v.steps, freq=v.freq, bf16_matmuls=v.mixed_precision == "bf16")
                    if v.enable else None),
        profiling=ProfilingOptions(
            enable=p.enable, start_step=p.start_step, end_step=p.end_step, trace_dir=cfg.trace_dir,
            record_shapes=p.record_shapes, with_stack=p.with_stack, profile_memory=p.profile_memory,
            memory_snapshot=p.memory_snapshot, expect_fp8=cfg.is_fp8 and not cfg.float8.emulate,
        ),
        checkpoint=checkpoint_options(c, dump_folder=cfg.job.dump_folder),
    )


def resolve_optimizer(o: OptimizerSection, *, bf16_master: bool, device: str) -> OptimizerOptions:
    """[optimizer] resolved against the master dtype and the device. A key never overrides another: what the chosen
    implementation cannot run is a one-line error naming both keys (`optimizer_conflict`)."""
    if o.implementation == "triton" and device != "cuda":
        raise ConfigError("optimizer.implementation='triton' runs a GPU kernel and this machine has no GPU; use 'auto' "
                          "(on a CPU: torch's fused kernel, or the eager update where the state is rounded)")
    dtypes = StateDtypes.resolve(bf16_master=bf16_master, exp_avg=o.exp_avg_dtype, exp_avg_sq=o.exp_avg_sq_dtype)
    bf16_update = o.bf16_update if bf16_master else None
    if problem := optimizer_conflict(o.implementation, dtypes, bf16_update):
        raise ConfigError(problem)
    rounded = is_rounded(dtypes, bf16_update or "nearest")
    return OptimizerOptions(
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
        implementation=resolve_implementation(o.implementation, device_type=device, rounded=rounded),
        state_dtypes=dtypes, bf16_update=bf16_update,
    )


def optimizer_conflict(implementation: str, dtypes: StateDtypes, bf16_update: str | None) -> str | None:
    """Why optimizer.implementation cannot run the state the other keys ask for, in one line naming both; None when
    it can. torch's kernels ('fused', 'torch_fused', 'foreach') keep the moments in the weights' dtype and round
    bf16 weights to nearest: moments of their own and stochastic or Kahan rounding need our AdamW ('auto')."""
    torchs = {"fused": "torch's fused kernel", "torch_fused": "torch's AdamW", "foreach": "torch's AdamW"}
    if not dtypes.in_master_dtype:
        key, value = next((k, v) for k, v in (("exp_avg_dtype", dtypes.exp_avg),
                                               ("exp_avg_sq_dtype", dtypes.exp_avg_sq)) if v != dtypes.master)
        if implementation in torchs:
            return (f"optimizer.{key}='{value}' with {dtypes.master} master weights needs our AdamW; "
                    f"optimizer.implementation='{implementation}' is {torchs[implementation]}, which keeps the moments "
                    "in the weights' dtype: use optimizer.implementation='auto'")
        if bf16_update == "nearest":
            return (f"optimizer.{key}='{value}' rounds bf16 master weights stochastically or with Kahan "
                    "compensation; optimizer.bf16_update='nearest' has no such path: use 'stochastic' or 'kahan'")
    if bf16_update in ("stochastic", "kahan") and implementation in torchs:
        return (f"optimizer.bf16_update='{bf16_update}' rounds bf16 master weights with our AdamW; "
                f"optimizer.implementation='{implementation}' is {torchs[implementation]}, which rounds them to "
                "nearest: use optimizer.implementation='auto', or optimizer.bf16_update='nearest' to run torch's")
    return None


def checkpoint_options(section: CheckpointSection, *, dump_folder: str) -> CheckpointOptions:
    """[checkpoint] as the manager takes it."""
    fields = {f.name for f in dataclasses.fields(CheckpointOptions)} - {"dump_folder"}
    return CheckpointOptions(dump_folder=dump_folder, **{name: getattr(section, name) for name in fields})
