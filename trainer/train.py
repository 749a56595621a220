"""The training loop. `scripts/train.py` parses the config and calls `train(cfg)`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import CheckpointManager, CheckpointState, RunInfo, run_tokenizer
from trainer.config import JobConfig
from trainer.data import build_data_loader
from trainer.distributed import (
    DistEnv, describe_device, destroy_distributed, init_distributed, set_determinism, world_size_from_env,
)
from trainer.evaluate import Evaluator
from trainer.hooks import StepHook
from trainer.log import EVERY_RANK
from trainer.loss import LossFn, build_loss_fn
from trainer.metrics import MetricsLogger, StepStats, device_peak_flops
from trainer.models import build_model, flops_per_token, is_moe, num_params, param_counts
from trainer.models.moe_balancer import MoEBalancer
from trainer.optim import build_lr_scheduler, build_optimizer, describe_param_groups, resolve_implementation
from trainer.parallel import build_parallel_model
from trainer.parallel.float8 import Float8ScalePrecompute, Fp8ExpertWeightsRefresh, Fp8HealthHook
from trainer.parallel.pipeline import Pipeline
from trainer.precision_schedule import resolve_phases, run_precision_schedule
from trainer.profiling import maybe_enable_profiling, maybe_record_memory_history
from trainer.run_files import describe_precision, write_run_files
from trainer.run_lock import RunLock, check_writable
from trainer.step import LossScaler, NonFiniteError, StepResult, TrainStep  # noqa: F401  (NonFiniteError re-exported)
from trainer.validate import ResolvedJob, validate_job

logger = logging.getLogger(__name__)


# Exit code of a run stopped by SIGTERM before its last step (after saving, when checkpoints are on):
# what a shell reports for a SIGTERM death (128 + 15), so SLURM requeue scripts can tell
# preemption (143) from completion (0) and from failure (1, 2). Ctrl-C (SIGINT) stops the same way
# and exits 130 (128 + 2); a second Ctrl-C quits at once, saving nothing.
EXIT_PREEMPTED = 143
EXIT_INTERRUPTED = 130
STOP_SIGNALS = {signal.SIGTERM: EXIT_PREEMPTED, signal.SIGINT: EXIT_INTERRUPTED}
# Written to the dump folder by such a stop (and removed when the next run starts): under torchrun,
# whose own exit code is 1 when its workers fail or it gets SIGTERM itself, this file is the signal.
PREEMPTED_MARKER = "preempted.json"


class StoppedBeforeFirstStep(BaseException):
    """SIGTERM or Ctrl-C before this process finished a step: raised by the signal handler, so the run stops now.

    A stop otherwise waits for the current step to end and saves it; the first step may be minutes of
    compilation away, and until it ends there is nothing the latest checkpoint (if any) does not hold. The
    command line exits with the signal's code (143 or 130) and no traceback. A BaseException, as
    KeyboardInterrupt is: raised wherever the signal lands, it must pass the `except Exception` of the code
    it interrupts (logging swallowed it when the signal came while a line was being written).
    """

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = STOP_SIGNALS[signal.Signals[signal_name]]


@dataclass
class TrainState:
    """Everything besides model/optimizer/scheduler/data that a resume needs."""

    step: int = 0
    mixed_precision: str = ""  # this run's train.mixed_precision, saved so a resume can say what changed
    resumed_mixed_precision: str = ""  # what the loaded checkpoint was written with ("" = not resumed)
    preempted: bool = False  # stopped by SIGTERM or Ctrl-C before the last step (not saved: a resume clears it)
    stopped_by: str = ""  # the signal that stopped it: "SIGTERM" or "SIGINT"

    @property
    def exit_code(self) -> int:
        return STOP_SIGNALS[signal.Signals[self.stopped_by]] if self.preempted else 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "mixed_precision": self.mixed_precision}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.resumed_mixed_precision = str(sd.get("mixed_precision", ""))


class Trainer:
    def __init__(self, cfg: JobConfig, job: ResolvedJob | None = None, *, end_step: int | None = None,
                 run_cfg: JobConfig | None = None):
        """`job` is what `validate_job` resolved (run here when not given): every user error is found
        before the process group exists.

        A phase of train.precision_schedule (trainer/precision_schedule.py) stops after `end_step`
        with a checkpoint there; `run_cfg` is then the whole run's config, written to config.toml.
        """
        job = job or validate_job(cfg, world_size=world_size_from_env())
        self.cfg, self.run_cfg, self.job = cfg, run_cfg or cfg, job
        self.end_step = end_step or cfg.train.steps
        t = cfg.train
        self.parallel_dims, self.model_args = job.parallel_dims, job.model_args
        self.env: DistEnv = init_distributed(timeout_seconds=cfg.distributed.init_timeout_seconds)
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
        self.model, self.float8, self.loss_fn = self._build_model(job)
        self.optimizer, self.scheduler = self._build_optimizer(bf16_master=job.build.fsdp.master_dtype == torch.bfloat16)
        self._log_model()
        self.scaler = LossScaler(enabled=t.mixed_precision == "fp16", device=self.device)
        self.step_fn = TrainStep(
            model=self.model, loss_fn=self.loss_fn, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, max_norm=t.max_norm, fused=cfg.optimizer.implementation != "foreach",
            device=self.device, pipeline=self.pipeline, loss_context=self.loss_context,
            cp=getattr(self.model, "cp", None),
        )
        self.hooks = self._build_hooks(job)
        self.state = TrainState(mixed_precision=t.mixed_precision)
        self.stop_requested = False
        self.stepped = False  # a step of this process has finished: a stop signal now waits for the step's end
        self.checkpoint = self._build_checkpoint()
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

    # -- building ------------------------------------------------------------

    def _build_model(self, job: ResolvedJob):
        """(model, FP8 report, loss function); under pp the model is this rank's stages and the loss
        function belongs to the last stage (None on other ranks)."""
        with torch.device("meta"):
            model = build_model(self.model_args)
        # Counted before wrappers: FSDP/TP parameters report their global shapes anyway.
        self._total_params = num_params(model)
        self._non_embedding_params = num_params(model, exclude_embeddings=True)
        t = self.cfg.train
        # The vocabulary-parallel loss (TP) runs eagerly; otherwise the head and loss compile with the blocks.
        compile_loss = job.build.compile and self.parallel_dims.tp == 1

        def build_loss(last: nn.Module) -> LossFn:
            return build_loss_fn(last, chunk_tokens=job.build.loss_chunk_tokens, compile=compile_loss)

        self.pipeline = None
        if job.pipeline is not None:
            # Stages built, parallelized and initialized one by one; `model` is this rank's stages
            # seen as one module with the full model's fqns (for the optimizer and checkpoints).
            self.pipeline = Pipeline(self.model_args, self.parallel_dims, options=job.pipeline, build=job.build,
                                     device=self.device, seed=t.seed, seq_len=t.seq_len // self.parallel_dims.cp,
                                     build_loss=build_loss)
            return self.pipeline.model, self.pipeline.float8_report, self.pipeline.loss_fn
        report = build_parallel_model(model, self.parallel_dims, options=job.build, device=self.device)
        # Materialize only this rank's shards, then fill them as if the model were whole.
        model.to_empty(device=self.device)
        model.init_weights(seed=t.seed)
        model.train()
        return model, report, build_loss(model)

    def _build_optimizer(self, *, bf16_master: bool):
        o, t = self.cfg.optimizer, self.cfg.train
        optimizer = build_optimizer(
            self.model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            implementation=resolve_implementation(o.implementation, compile_model=t.compile_model,
                                                  device_type=self.device.type),
            # BF16AdamW's update compiles only on a GPU: on a (loaded 2-core) CPU its compile had not finished the
            # debug model's first step in 15 minutes, where the eager update takes 0.4 s.
            seed=t.seed, compile=t.compile_model and self.device.type == "cuda",
            bf16_update=o.bf16_update if bf16_master else None,
        )
        s = self.cfg.scheduler
        scheduler = build_lr_scheduler(
            optimizer, warmup_steps=s.warmup_steps, total_steps=t.steps, decay_type=s.decay_type,
            min_lr_ratio=s.min_lr_ratio, wsd_decay_ratio=s.wsd_decay_ratio,
        )
        return optimizer, scheduler

    def _log_model(self) -> None:
        # The startup lines users check, in this order: Applied Float8 training (from
        # build_parallel_model), Optimizer groups, Model.
        logger.info("Optimizer groups: %s", describe_param_groups(self.optimizer))
        args = self.model_args
        logger.info(
            "Model: %s, %s parameters (%s non-embedding), dim=%d, layers=%d, heads=%d/%d kv, vocab=%d",
            self.cfg.model.flavor, f"{self._total_params:,}", f"{self._non_embedding_params:,}",
            args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size,
        )
        logger.info(describe_precision(self.cfg, self.job))
        if is_moe(args):
            logger.info(
                "MoE: %s active parameters per token (MFU counts these); %d routed experts top-%d (%s scores%s), "
                "%d shared, %d dense layers; aux_loss_coef=%g, bias_update_rate=%g, capacity_factor=%g",
                f"{param_counts(args)[1]:,}", args.n_experts, args.top_k, args.score_func,
                ", renormalized" if args.route_norm else "", args.n_shared_experts, args.n_dense_layers,
                args.aux_loss_coef, args.bias_update_rate, args.capacity_factor,
            )

    def _build_hooks(self, job: ResolvedJob) -> list[StepHook]:
        """The per-step hooks (trainer/hooks.py) this job needs, in the order they run."""
        cfg, t, hooks = self.cfg, self.cfg.train, []
        if is_moe(self.model_args):
            # Expert loads summed over every rank of the stage (ep ranks are dp ranks too; tp ranks route
            # slices of the same sequences); on every rank, since its collectives are (a pipeline rank may
            # hold no MoE layer).
            hooks.append(MoEBalancer(self.model, bias_update_rate=self.model_args.bias_update_rate,
                                     stage_group=self.parallel_dims.mesh("stage").get_group(),
                                     pp_group=self.pipeline.pp_group if self.pipeline else None))
        refresh = Fp8ExpertWeightsRefresh(self.model)
        if any(cache.per_step for cache in refresh.caches):  # FP8 experts' weights: quantized once per step
            hooks.append(refresh)
        f8 = self.float8
        if f8 and f8.enabled and f8.fsdp_float8_all_gather:
            hooks.append(Float8ScalePrecompute(self.model))
        if f8 and f8.enabled and cfg.metrics.fp8_stats_freq:
            hooks.append(Fp8HealthHook(self.model, recipe=cfg.float8.recipe, every=cfg.metrics.fp8_stats_freq))
        if job.validation_source is not None:
            evaluator = Evaluator(
                job.validation_source, model=self.model, batch_loss=self.step_fn.eval_loss, seq_len=t.seq_len,
                batch_size=t.batch_size, steps=cfg.validation.steps, freq=cfg.validation.freq, last_step=t.steps,
                dp_rank=self.dp_mesh.get_local_rank(), dp_degree=self.parallel_dims.dp, device=self.device,
                dp_group=self.parallel_dims.mesh("dp_cp").get_group(), loss_context=self.loss_context,
            )
            logger.info("validation: %r, %d batches every %d steps (%s tokens each time)", job.validation_source,
                        cfg.validation.steps, cfg.validation.freq, f"{evaluator.tokens:,}")
            hooks.append(evaluator)
        return hooks

    def _build_checkpoint(self) -> CheckpointManager:
        cfg, pd = self.cfg, self.parallel_dims
        return CheckpointManager(
            cfg.checkpoint, dump_folder=cfg.job.dump_folder,
            state=CheckpointState(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                  data_loader=self.data_loader, train_state=self.state, loss_scaler=self.scaler,
                                  restart_data=cfg.checkpoint.restart_data),
            run=RunInfo(flavor=cfg.model.flavor, model_args=self.model_args, mixed_precision=cfg.train.mixed_precision,
                        layout={"dp_replicate": pd.dp_replicate, "dp_shard": pd.dp_shard, "tp": pd.tp,
                                "ep": pd.ep, "pp": pd.pp, "cp": pd.cp, "world_size": self.env.world_size},
                        **run_tokenizer(cfg.data.source, cfg.data.tokenizer)),
        )

    # -- one step ------------------------------------------------------------

    def loss_context(self):
        if self.parallel_dims.tp > 1 and self.cfg.distributed.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """The next optimizer step (trainer/step.py) with every hook around it, without a host sync.

        A non-finite step never reaches the weights (the fused optimizer skips it on the
        device, and the hooks mask their updates); `check_finite()` reports it on the host later.
        """
        step = self.state.step + 1
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.step_context(step))
            result = self.step_fn(microbatches, step)
        for hook in self.hooks:
            hook.after_optimizer_step(step, result.found_inf)
        return result

    def check_finite(self) -> int:
        """Report the non-finite steps since the last check (TrainStep.check_finite). note: a host sync."""
        return self.step_fn.check_finite(on_nonfinite=self.cfg.train.on_nonfinite,
                                         record=self.metrics.record_nonfinite)

    # -- the loop ------------------------------------------------------------

    def _request_stop(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.stop_requested:
            raise KeyboardInterrupt  # the second Ctrl-C: quit now
        if not self.stepped:
            raise StoppedBeforeFirstStep(name)  # nothing to save yet: do not wait out step 1's compilation
        logger.warning("received %s: stopping after this step%s", name, " (Ctrl-C again to quit at once, saving "
                       "nothing)" if signum == signal.SIGINT else "", extra=EVERY_RANK)
        self.stop_requested = True
        self.state.stopped_by = self.state.stopped_by or name

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
            written = write_run_files(cfg.job.dump_folder, cfg=cfg, run_cfg=self.run_cfg, job=self.job)
            logger.info("outputs: %s (%s, metrics.jsonl%s%s)", cfg.job.dump_folder, ", ".join(written),
                        ", tb/" if cfg.metrics.enable_tensorboard else "",
                        f", {cfg.checkpoint.folder}/ every {cfg.checkpoint.interval} steps" if cfg.checkpoint.enable
                        else "")
            (Path(cfg.job.dump_folder) / PREEMPTED_MARKER).unlink(missing_ok=True)  # from a preempted earlier run
        previous = {sig: signal.signal(sig, self._request_stop) for sig in STOP_SIGNALS}
        p = cfg.profiling
        profiling = maybe_enable_profiling(
            enable=p.enable, start_step=p.start_step, end_step=p.end_step, trace_dir=cfg.trace_dir,
            rank=self.env.rank, record_shapes=p.record_shapes, with_stack=p.with_stack,
            profile_memory=p.profile_memory, expect_fp8=cfg.is_fp8 and not cfg.float8.emulate,
        )
        memory = maybe_record_memory_history(
            enable=p.memory_snapshot, snapshot_dir=str(Path(cfg.trace_dir) / "memory_snapshot"), rank=self.env.rank
        )
        try:
            with profiling as profiler, memory as memory_recorder:
                self._loop(profiler, memory_recorder)
        except StoppedBeforeFirstStep as stop:
            self._stopped_before_first_step(stop)
            raise  # not a return: a barrier in teardown would wait for ranks still compiling or in a collective
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.check_finite()
        marker = Path(cfg.job.dump_folder) / PREEMPTED_MARKER
        if self.state.preempted:
            self.checkpoint.wait()  # the stop's checkpoint is complete before we say so
            saved = self.checkpoint.last_saved_step == self.state.step
            what = f"checkpoint step-{self.state.step} saved" if saved else "no checkpoint saved (" + (
                "its save failed, see above" if self.checkpoint.enable else "checkpoint.enable=false") + ")"
            self.state.stopped_by = self.state.stopped_by or "SIGTERM"  # another rank's signal
            logger.warning("stopped by %s at step %d of %d; %s; exiting with code %d", self.state.stopped_by,
                           self.state.step, cfg.train.steps, what, self.state.exit_code)
            if self.env.rank == 0:
                # torchrun exits 1 whatever its workers return: requeue scripts can read this file instead.
                marker.write_text(json.dumps({"step": self.state.step, "of_steps": cfg.train.steps,
                                              "checkpoint_saved": saved, "signal": self.state.stopped_by}) + "\n")
        elif self.end_step == cfg.train.steps:  # not a precision-schedule phase that ends before the run does
            # With checkpoint.on_save_error="continue", a failed last save is an error here (exit 2), not a success.
            self.checkpoint.require_saved(self.state.step)
            logger.info("training finished at step %d", self.state.step)
        return self.state

    def _stopped_before_first_step(self, stop: StoppedBeforeFirstStep) -> None:
        """The one line and preempted.json of a stop before this process's first step ended (each rank's own)."""
        step, saved = self.state.step, self.checkpoint.last_saved_step == self.state.step
        self.state.preempted, self.state.stopped_by = True, stop.signal_name
        logger.warning("stopped by %s before step %d finished: nothing to save (%s); exiting with code %d",
                       stop.signal_name, step + 1, f"a relaunch resumes checkpoint step-{step}" if saved
                       else "no step had finished", stop.exit_code, extra=EVERY_RANK)
        if self.env.rank == 0:
            (Path(self.cfg.job.dump_folder) / PREEMPTED_MARKER).write_text(json.dumps(
                {"step": step, "of_steps": self.cfg.train.steps, "checkpoint_saved": saved,
                 "signal": stop.signal_name}) + "\n")

    def _loop(self, profiler, memory_recorder) -> None:
        cfg, t = self.cfg, self.cfg.train
        first_step = self.state.step + 1
        interval = _Interval()
        # Tokens per device per step, each token counted once (TP and PP ranks share their dp rank's tokens).
        local_tokens = t.batch_size * t.seq_len * t.grad_accum_steps * self.parallel_dims.dp / self.env.world_size
        logger.info("training steps %d-%d, %s tokens per step; the first step includes %swarm-up", first_step,
                    self.end_step, f"{round(local_tokens * self.env.world_size):,}",
                    "compilation and " if t.compile_model else "")
        stopping = False
        while self.state.step < self.end_step and not stopping:
            lr = self.scheduler.get_last_lr()[0]
            result = self.train_step(self.data_loader.next_batch())
            self.state.step += 1
            self.stepped = True
            step = self.state.step
            interval.add(local_tokens)
            profiler.step(step)
            if step == cfg.profiling.end_step:
                memory_recorder.dump(f"step{step}")
            if (step == first_step or step % cfg.metrics.log_freq == 0 or step in (t.steps, self.end_step)
                    or any(hook.log_due(step) for hook in self.hooks)):
                self._log(step, result, lr=lr, interval=interval, first_step=first_step)
                interval = _Interval()
            stopping = self._agree_to_stop()
            # A stop at the last step is a completed run, not a preemption.
            self.state.preempted = stopping and step < t.steps
            # The end of a precision-schedule phase saves like a stop: the next phase resumes it.
            self.checkpoint.maybe_save(step, final=step == t.steps, stopping=stopping or step == self.end_step,
                                       before_save=self.check_finite)

    def _log(self, step: int, result: StepResult, *, lr: float, interval: _Interval, first_step: int) -> None:
        """One log line (note: host syncs): this step's loss and grad norm, then what every hook reports."""
        self.check_finite()
        # Mean over data- and context-parallel ranks (each cp rank's is the mean over its chunks; TP ranks hold
        # the same loss).
        dist.all_reduce(result.loss, op=dist.ReduceOp.AVG, group=self.parallel_dims.mesh("dp_cp").get_group())
        loss, norm = result.loss.item(), result.grad_norm.item()
        # Timed before the hooks report: an evaluation is not training time.
        seconds = time.perf_counter() - interval.start
        extra: dict[str, float] = {}
        for hook in self.hooks:
            extra.update(hook.on_log(step))
        self.metrics.log(
            StepStats(step=step, loss=loss, grad_norm=norm, lr=lr, tokens=int(interval.tokens), seconds=seconds,
                      steps_in_interval=interval.steps, extra=extra),
            first_step=first_step,
        )

    def close(self) -> None:
        try:
            self.checkpoint.close()  # a background save completes (or fails loudly) before exit
        finally:
            self.metrics.close()


@dataclass
class _Interval:
    """Steps and tokens since the last log line, and when it began."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: float = 0

    def add(self, tokens: float) -> None:
        self.steps += 1
        self.tokens += tokens


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
        folders.append((cfg.trace_dir, "profiling.trace_dir"))
    return folders
