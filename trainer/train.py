"""The training loop. `scripts/train.py` parses the config and calls `train(cfg)`."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.errors import UserError
from trainer.checkpoint import CheckpointManager, CheckpointState, RunInfo
from trainer.config import JobConfig
from trainer.data import build_data_loader
from trainer.distributed import (
    DistEnv, describe_device, destroy_distributed, init_distributed, set_determinism, world_size_from_env,
)
from trainer.evaluate import Evaluator
from trainer.metrics import MetricsLogger, StepStats, device_peak_flops
from trainer.models import build_model, flops_per_token, is_moe, num_params, param_counts
from trainer.models.moe import MoEBalancer
from trainer.optim import build_lr_scheduler, build_optimizer, describe_param_groups
from trainer.parallel import build_parallel_model
from trainer.parallel.float8 import float8_weight_stats, precompute_float8_scales
from trainer.parallel.fp8_health import Fp8HealthMonitor
from trainer.parallel.pipeline import Pipeline
from trainer.precision_schedule import resolve_phases, run_precision_schedule
from trainer.profiling import maybe_enable_profiling, maybe_record_memory_history
from trainer.run_lock import RunLock, check_writable
from trainer.validate import ResolvedJob, validate_job

logger = logging.getLogger(__name__)


# Exit code of a run stopped by SIGTERM before its last step (after saving, when checkpoints are on):
# what a shell reports for a SIGTERM death (128 + 15), so SLURM requeue scripts can tell
# preemption (143) from completion (0) and from failure (1, 2).
EXIT_PREEMPTED = 143
# Written to the dump folder by such a stop (and removed when the next run starts): under torchrun,
# whose own exit code is 1 when its workers fail or it gets SIGTERM itself, this file is the signal.
PREEMPTED_MARKER = "preempted.json"


class NonFiniteError(UserError, RuntimeError):
    """A NaN/inf loss or gradient norm with train.on_nonfinite='stop'."""


@dataclass
class TrainState:
    """Everything besides model/optimizer/scheduler/data that a resume needs."""

    step: int = 0
    mixed_precision: str = ""  # this run's train.mixed_precision, saved so a resume can say what changed
    resumed_mixed_precision: str = ""  # what the loaded checkpoint was written with ("" = not resumed)
    preempted: bool = False  # stopped by SIGTERM before the last step (not saved: a resume clears it)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "mixed_precision": self.mixed_precision}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.resumed_mixed_precision = str(sd.get("mixed_precision", ""))


class LossScaler:
    """Dynamic loss scaling for fp16 (bf16/fp8 need none), kept on the device.

    Scale and growth counter are device tensors updated with torch.where, so fp16
    needs no host sync per step; works on DTensor gradients, unlike
    torch.amp.GradScaler with FSDP2.
    """

    def __init__(self, *, enabled: bool, device: torch.device, init_scale: float = 2.0**16,
                 growth_interval: int = 2000):
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.scale = torch.tensor(init_scale if enabled else 1.0, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        if not self.enabled:
            return
        self.good_steps = torch.where(found_inf, 0, self.good_steps + 1)
        grow = self.good_steps >= self.growth_interval
        self.scale = torch.where(found_inf, self.scale / 2, torch.where(grow, self.scale * 2, self.scale))
        self.good_steps = torch.where(grow, 0, self.good_steps)

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale.item(), "good_steps": int(self.good_steps.item())}

    def load_state_dict(self, sd: dict[str, float | int]) -> None:
        self.scale.fill_(float(sd["scale"]))
        self.good_steps.fill_(int(sd["good_steps"]))


def grad_norm(params: list[torch.nn.Parameter], *, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """True global L2 norm over all gradients (DTensors on any mesh), as a plain device tensor.

    Under pipeline parallelism each pp rank holds other parameters: pp_group sums the squared norms.
    """
    # Grouped by mesh: with expert parallelism the routed experts live on another mesh than the
    # dense weights, and one norm cannot mix DTensors of two meshes.
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            # Partial over sharded mesh axes: full_tensor() all-reduces the squared sums.
            norm = norm.full_tensor()
        norms.append(norm)
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    if pp_group is not None:
        sq = norm.float() ** 2
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pp_group)
        norm = sq.sqrt()
    return norm


class Trainer:
    def __init__(self, cfg: JobConfig, job: ResolvedJob | None = None, *, end_step: int | None = None,
                 run_cfg: JobConfig | None = None):
        """`job` is what `validate_job` resolved (run here when not given): every user error is found
        before the process group exists.

        A phase of train.precision_schedule (trainer/precision_schedule.py) stops after `end_step`
        with a checkpoint there; `run_cfg` is then the whole run's config, written to config.toml.
        """
        job = job or validate_job(cfg, world_size=world_size_from_env())
        self.cfg = cfg
        self.run_cfg = run_cfg or cfg
        self.end_step = end_step or cfg.train.steps
        t, d = cfg.train, cfg.distributed
        self.parallel_dims, self.model_args = job.parallel_dims, job.model_args
        self.env: DistEnv = init_distributed(timeout_seconds=d.init_timeout_seconds)
        self.device = self.env.device
        set_determinism(seed=t.seed, deterministic=t.deterministic)
        self.parallel_dims.build_meshes(self.device.type)
        self.dp_mesh = self.parallel_dims.mesh("dp")
        logger.info("parallelism: %s on %s", self.parallel_dims.summary, describe_device(self.device))

        self.data_loader = build_data_loader(
            job.data_source, seed=cfg.data.seed, shuffle=cfg.data.shuffle, seq_len=t.seq_len,
            batch_size=t.batch_size, grad_accum_steps=t.grad_accum_steps, dp_rank=self.dp_mesh.get_local_rank(),
            dp_degree=self.parallel_dims.dp,
        )

        self.model, self.float8 = self._build_model(job)
        self.fp8_health = None
        if self.float8 and self.float8.enabled and cfg.metrics.fp8_stats_freq:
            self.fp8_health = Fp8HealthMonitor(self.model, recipe=cfg.float8.recipe)
        self.evaluator = None
        if job.validation_source is not None:
            self.evaluator = Evaluator(
                job.validation_source, seq_len=t.seq_len, batch_size=t.batch_size, steps=cfg.validation.steps,
                dp_rank=self.dp_mesh.get_local_rank(), dp_degree=self.parallel_dims.dp, device=self.device,
                dp_group=self.dp_mesh.get_group(), loss_context=self.loss_context,
                batch_loss=self.pipeline.eval_loss if self.pipeline else None,
            )
            logger.info("validation: %r, %d batches every %d steps (%s tokens each time)", job.validation_source,
                        cfg.validation.steps, cfg.validation.freq, f"{self.evaluator.tokens:,}")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optimizer
        self.optimizer = build_optimizer(
            self.model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            implementation=o.implementation, seed=t.seed, compile=t.compile_model,
            bf16_update=o.bf16_update if d.master_dtype == "bf16" else None,
        )
        # The startup lines users check, in this order: Applied Float8 training (from
        # build_parallel_model), Optimizer groups, Model.
        logger.info("Optimizer groups: %s", describe_param_groups(self.optimizer))
        args = self.model_args
        logger.info(
            "Model: %s, %s parameters (%s non-embedding), dim=%d, layers=%d, heads=%d/%d kv, vocab=%d",
            cfg.model.flavor, f"{self._total_params:,}", f"{self._non_embedding_params:,}",
            args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size,
        )
        if is_moe(args):
            logger.info(
                "MoE: %s active parameters per token (MFU counts these); %d routed experts top-%d (%s scores%s), "
                "%d shared, %d dense layers; aux_loss_coef=%g, bias_update_rate=%g, capacity_factor=%g",
                f"{param_counts(args)[1]:,}", args.n_experts, args.top_k, args.score_func,
                ", renormalized" if args.route_norm else "", args.n_shared_experts, args.n_dense_layers,
                args.aux_loss_coef, args.bias_update_rate, args.capacity_factor,
            )
        # Expert loads summed over every data-parallel rank (ep ranks are dp ranks too).
        self.moe_balancer = MoEBalancer(
            self.model, bias_update_rate=getattr(args, "bias_update_rate", 0.0), group=self.dp_mesh.get_group()
        )
        s = cfg.scheduler
        self.scheduler = build_lr_scheduler(
            self.optimizer, warmup_steps=s.warmup_steps, total_steps=t.steps, decay_type=s.decay_type,
            min_lr_ratio=s.min_lr_ratio, wsd_decay_ratio=s.wsd_decay_ratio,
        )
        self.fused_optimizer = o.implementation == "fused"
        self.aux_loss_sum = torch.zeros((), device=self.device)  # MoE aux loss since the last log step
        self.scaler = LossScaler(enabled=t.mixed_precision == "fp16", device=self.device)
        self._pending_norms: list[tuple[int, torch.Tensor]] = []
        self.precompute_fp8_scales = bool(
            self.float8 and self.float8.enabled and self.float8.fsdp_float8_all_gather
        )
        self.state = TrainState(mixed_precision=t.mixed_precision)
        self.stop_requested = False

        pd = self.parallel_dims
        self.checkpoint = CheckpointManager(
            cfg.checkpoint, dump_folder=cfg.job.dump_folder,
            state=CheckpointState(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                  data_loader=self.data_loader, train_state=self.state, loss_scaler=self.scaler),
            run=RunInfo(flavor=cfg.model.flavor, model_args=self.model_args, mixed_precision=t.mixed_precision,
                        layout={"dp_replicate": pd.dp_replicate, "dp_shard": pd.dp_shard, "tp": pd.tp,
                                "ep": pd.ep, "pp": pd.pp, "world_size": self.env.world_size}),
        )
        # Resuming overwrites the fresh state of every piece above.
        self.checkpoint.resume()
        # After resume: a fresh run starts fresh metrics files, a resumed one continues them.
        self.metrics = MetricsLogger(
            dump_folder=cfg.job.dump_folder, rank=self.env.rank, total_steps=t.steps,
            flops_per_token=flops_per_token(self.model_args, t.seq_len), peak_flops=device_peak_flops(self.device),
            device=self.device, enable_tensorboard=cfg.metrics.enable_tensorboard,
            enable_jsonl=cfg.metrics.enable_jsonl, loss_spike_factor=cfg.metrics.loss_spike_factor,
            fp8_converted_fraction=self.float8.converted_fraction if self.float8 else None,
            resumed_step=self.state.step,
        )

    def _build_model(self, job: ResolvedJob):
        with torch.device("meta"):
            model = build_model(self.model_args)
        # Counted before wrappers: FSDP/TP parameters report their global shapes anyway.
        self._total_params = num_params(model)
        self._non_embedding_params = num_params(model, exclude_embeddings=True)
        self.pipeline = None
        if job.pipeline is not None:
            # Stages built, parallelized and initialized one by one; `model` is this rank's stages
            # seen as one module with the full model's fqns (for the optimizer and checkpoints).
            self.pipeline = Pipeline(self.model_args, self.parallel_dims, options=job.pipeline, build=job.build,
                                     device=self.device, seed=self.cfg.train.seed,
                                     grad_accum_steps=self.cfg.train.grad_accum_steps)
            return self.pipeline.model, self.pipeline.float8_report
        report = build_parallel_model(model, self.parallel_dims, options=job.build, device=self.device)
        # Materialize only this rank's shards, then fill them as if the model were whole.
        model.to_empty(device=self.device)
        model.init_weights(seed=self.cfg.train.seed)
        model.train()
        return model, report

    # -- one step ------------------------------------------------------------

    def loss_context(self):
        if self.parallel_dims.tp > 1 and self.cfg.distributed.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the microbatches and one optimizer step, without a host sync.

        Returns (this rank's mean loss, global grad norm), both device tensors. A
        non-finite step never reaches the weights (the fused optimizer skips it on
        the device); `check_finite()` reports it on the host later.
        """
        if self.pipeline is not None:
            # The schedule runs forward and backward of every stage; the loss comes from the last stage.
            loss = self.pipeline.forward_backward(microbatches, loss_context=self.loss_context,
                                                  loss_scale=self.scaler.scale if self.scaler.enabled else None)
        else:
            loss = self._forward_backward(microbatches)
        norm = grad_norm(self.params, pp_group=self.pipeline.pp_group if self.pipeline else None)
        if self.scaler.enabled:
            norm = norm / self.scaler.scale
        found_inf = ~torch.isfinite(norm)
        self._optimizer_step(norm, found_inf)
        if self.moe_balancer:
            self.moe_balancer.after_step()  # expert biases move with the step's loads
        self.scaler.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._pending_norms.append((self.state.step + 1, norm))
        return loss, norm

    def _forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        n = len(microbatches)
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self.loss_context():
                loss = self.model(inputs, labels)
                if isinstance(loss, DTensor):  # replicated under loss parallel
                    loss = loss.to_local()
                # MoE: the load-balancing loss of this forward joins the objective; `loss` stays the LM loss.
                aux = getattr(self.model, "aux_loss", None)
                objective = loss if aux is None else loss + aux
                # Every microbatch has the same number of tokens, so the mean of the
                # microbatch means is the mean over the whole global batch.
                (objective * (self.scaler.scale / n) if self.scaler.enabled else objective / n).backward()
            loss_sum += loss.detach()
            if aux is not None:
                self.aux_loss_sum += aux.detach() / n
        return loss_sum / n

    def _optimizer_step(self, norm: torch.Tensor, found_inf: torch.Tensor) -> None:
        max_norm = self.cfg.train.max_norm
        # Clipping factor >= 1 that the gradients are divided by.
        clip = torch.clamp(norm / max_norm, min=1.0) if max_norm > 0 else torch.ones_like(norm)
        if self.fused_optimizer:
            # The fused AdamW kernel divides gradients by grad_scale (loss scale x clip)
            # and skips the whole update when found_inf is set: clipping and the
            # non-finite skip cost no extra pass over the gradients and no host sync.
            self.optimizer.grad_scale = (self.scaler.scale * clip).nan_to_num(1.0)
            self.optimizer.found_inf = found_inf.float()
            self.optimizer.step()
        else:
            # note: a CPU-GPU sync point (only with optimizer.implementation='foreach').
            if found_inf.item():
                return
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params]
            torch._foreach_div_(grads, self.scaler.scale * clip)
            self.optimizer.step()
        if self.precompute_fp8_scales:
            precompute_float8_scales(self.model)

    def check_finite(self) -> int:
        """Report the non-finite steps since the last check; raise under on_nonfinite='stop'.

        note: a CPU-GPU sync point; the loop calls it at log steps (and before saving).
        Returns the number of non-finite steps found.
        """
        if not self._pending_norms:
            return 0
        steps = [s for s, _ in self._pending_norms]
        norms = torch.stack([n for _, n in self._pending_norms]).tolist()
        self._pending_norms.clear()
        bad = [(s, x) for s, x in zip(steps, norms) if not math.isfinite(x)]
        for step, value in bad:
            if self.scaler.enabled:
                logger.warning("step %d: fp16 overflow (grad_norm=%s), step skipped; loss scale now %g",
                               step, value, self.scaler.scale.item())
                continue
            self.metrics.record_nonfinite()
            message = f"non-finite loss or gradient at step {step} (grad_norm={value}); the step was not applied"
            if self.cfg.train.on_nonfinite == "stop":
                raise NonFiniteError(
                    message + ". Stopping: lower optimizer.lr or raise scheduler.warmup_steps, "
                    "or set train.on_nonfinite='skip' to skip such steps (see docs/debug.md)"
                )
            logger.warning("%s (train.on_nonfinite='skip')", message)
        return len(bad)

    # -- the loop ------------------------------------------------------------

    def _request_stop(self, signum, frame) -> None:
        logger.warning("received %s: stopping after this step", signal.Signals(signum).name)
        self.stop_requested = True

    def _agree_to_stop(self) -> bool:
        """True on every rank once any rank got SIGTERM, so all stop (and save) after the same step.

        A CPU tensor: the all-reduce goes over gloo and never waits for the GPU.
        """
        flag = torch.tensor([int(self.stop_requested)], dtype=torch.int32)
        if self.env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def run(self) -> TrainState:
        cfg = self.cfg
        Path(cfg.job.dump_folder).mkdir(parents=True, exist_ok=True)
        if self.env.rank == 0:
            (Path(cfg.job.dump_folder) / "config.toml").write_text(self.run_cfg.to_toml())
            (Path(cfg.job.dump_folder) / PREEMPTED_MARKER).unlink(missing_ok=True)  # from a preempted earlier run
        previous = signal.signal(signal.SIGTERM, self._request_stop)
        p = cfg.profiling
        profiling = maybe_enable_profiling(
            enable=p.enable, start_step=p.start_step, end_step=p.end_step, trace_dir=p.trace_dir,
            rank=self.env.rank, record_shapes=p.record_shapes, with_stack=p.with_stack,
            profile_memory=p.profile_memory, expect_fp8=cfg.is_fp8 and not cfg.float8.emulate,
        )
        memory = maybe_record_memory_history(
            enable=p.memory_snapshot, snapshot_dir=str(Path(p.trace_dir) / "memory_snapshot"), rank=self.env.rank
        )
        try:
            with profiling as profiler, memory as memory_recorder:
                self._loop(profiler, memory_recorder)
        finally:
            signal.signal(signal.SIGTERM, previous)
        self.check_finite()
        marker = Path(cfg.job.dump_folder) / PREEMPTED_MARKER
        if self.state.preempted:
            self.checkpoint.wait()  # the stop's checkpoint is complete before we say so
            saved = self.checkpoint.last_saved_step == self.state.step
            what = f"checkpoint step-{self.state.step} saved" if saved else "no checkpoint saved (" + (
                "its save failed, see above" if self.checkpoint.enable else "checkpoint.enable=false") + ")"
            logger.warning("stopped by SIGTERM at step %d of %d; %s; exiting with code %d", self.state.step,
                           cfg.train.steps, what, EXIT_PREEMPTED)
            if self.env.rank == 0:
                # torchrun exits 1 whatever its workers return: requeue scripts can read this file instead.
                marker.write_text(json.dumps({"step": self.state.step, "of_steps": cfg.train.steps,
                                              "checkpoint_saved": saved}) + "\n")
        elif self.end_step == cfg.train.steps:  # not a precision-schedule phase that ends before the run does
            logger.info("training finished at step %d", self.state.step)
        return self.state

    def _loop(self, profiler, memory_recorder) -> None:
        cfg, t = self.cfg, self.cfg.train
        first_step = self.state.step + 1
        interval_start, interval_steps, interval_tokens = time.perf_counter(), 0, 0
        # Tokens per device per step, each token counted once (TP and PP ranks share their dp rank's tokens).
        local_tokens = t.batch_size * t.seq_len * t.grad_accum_steps * self.parallel_dims.dp / self.env.world_size
        stopping = False
        while self.state.step < self.end_step and not stopping:
            lr = self.scheduler.get_last_lr()[0]
            health_step = self.fp8_health is not None and (self.state.step + 1) % cfg.metrics.fp8_stats_freq == 0
            with self.fp8_health.collect() if health_step else contextlib.nullcontext():
                loss, norm = self.train_step(self.data_loader.next_batch())
            self.state.step += 1
            step = self.state.step
            extra = {**float8_weight_stats(self.model), **self.fp8_health.report()} if health_step else None
            interval_steps += 1
            interval_tokens += local_tokens
            profiler.step(step)
            if step == cfg.profiling.end_step:
                memory_recorder.dump(f"step{step}")
            validation = None
            if self.evaluator and (step % cfg.validation.freq == 0 or step == t.steps):
                started = time.perf_counter()
                validation = self.evaluator.evaluate(self.model)
                interval_start += time.perf_counter() - started  # not training time
            if (step == first_step or step % cfg.metrics.log_freq == 0 or step in (t.steps, self.end_step)
                    or validation or extra):
                self.check_finite()
                # Mean over data-parallel ranks (TP ranks hold the same loss).
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_mesh.get_group())
                loss_value, norm_value = loss.item(), norm.item()
                moe = {}
                if self.moe_balancer:
                    dist.all_reduce(self.aux_loss_sum, op=dist.ReduceOp.AVG, group=self.dp_mesh.get_group())
                    moe = {"aux_loss": self.aux_loss_sum.item() / interval_steps, **self.moe_balancer.metrics()}
                    self.aux_loss_sum.zero_()
                self.metrics.log(
                    StepStats(step=step, loss=loss_value, grad_norm=norm_value, lr=lr, tokens=int(interval_tokens),
                              seconds=time.perf_counter() - interval_start, steps_in_interval=interval_steps,
                              validation=validation, extra={**(extra or {}), **moe}),
                    first_step=first_step,
                )
                interval_start, interval_steps, interval_tokens = time.perf_counter(), 0, 0
            stopping = self._agree_to_stop()
            # A stop at the last step is a completed run, not a preemption.
            self.state.preempted = stopping and step < t.steps
            # The end of a precision-schedule phase saves like a stop: the next phase resumes it.
            self.checkpoint.maybe_save(step, final=step == t.steps, stopping=stopping or step == self.end_step,
                                       before_save=self.check_finite)

    def close(self) -> None:
        try:
            self.checkpoint.close()  # a background save completes (or fails loudly) before exit
        finally:
            self.metrics.close()


def train(cfg: JobConfig) -> TrainState:
    """Validate, build everything, train, and always tear down (writers, process group)."""
    # The one validation pass, before the process group or any tensor exists.
    # With train.precision_schedule: one validated job per phase (the schedule overrides train.mixed_precision).
    jobs = resolve_phases(cfg, world_size=world_size_from_env()) if cfg.train.precision_schedule else []
    job = None if jobs else validate_job(cfg, world_size=world_size_from_env())
    for folder, key in output_folders(cfg):
        check_writable(folder, key=key)
    # Global rank 0 owns the dump folder before any rank writes to it.
    lock = RunLock(cfg.job.dump_folder) if int(os.environ.get("RANK", "0")) == 0 else None
    if lock is not None:
        lock.acquire()
    trainer, ok = None, False
    try:
        if jobs:
            state = run_precision_schedule(cfg, jobs, trainer_cls=Trainer)
        else:
            trainer = Trainer(cfg, job)
            state = trainer.run()
        ok = True
        return state
    finally:
        try:
            if trainer is not None:
                trainer.close()
            destroy_distributed(barrier=ok)
        finally:
            if lock is not None:
                lock.release()


def output_folders(cfg: JobConfig) -> list[tuple[str, str]]:
    """Every folder the run will write to, with the config key that names it."""
    folders = [(cfg.job.dump_folder, "job.dump_folder")]
    if cfg.checkpoint.enable:
        folders.append((str(Path(cfg.job.dump_folder) / cfg.checkpoint.folder), "checkpoint.folder"))
    if cfg.profiling.enable:
        folders.append((cfg.profiling.trace_dir, "profiling.trace_dir"))
    return folders
