"""The training loop. `scripts/train.py` parses the config and calls `train(cfg)`.

`train(cfg)` validates the config once (trainer.validate: a `ResolvedJob` of typed options) and runs it:
one `Trainer(job)`, or one per phase of train.precision_schedule. The Trainer reads no config.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from trainer.checkpoint import CheckpointManager, CheckpointState, DelayedScalingPart, RngPart, RunInfo
from trainer.checkpoint.ema import EMAPart, EMAWeights
from trainer.config import JobConfig
from trainer.data import DataPosition, build_data_loader
from trainer.data.mix import MixtureTokens
from trainer.errors import UserError
from trainer.distributed import (
    DistEnv, describe_device, destroy_distributed, init_distributed, set_determinism, world_size_from_env,
)
from trainer.hooks import StepHook
from trainer.log import EVERY_RANK
from trainer.loss import LossFn
from trainer.metrics.events import EventLog
from trainer.metrics.logger import MetricsLogger, StepStats, check_run_files, device_peak_flops
from trainer.metrics.profiling import maybe_enable_profiling, maybe_record_memory_history
from trainer.models.counts import num_params_for
from trainer.models import MTPLossMetrics, family_of, flops_per_token, mtp_or_plain_loss_fn
from trainer.models.moe_balancer import MoEBalancer
from trainer.optim import (
    OptimizerPart, SchedulerPart, build_lr_scheduler, build_optimizer, describe_optimizer_state, describe_param_groups,
)
from trainer.parallel.build import build_model_part
from trainer.parallel.compile import CompileTimes, start_compile_workers
from trainer.parallel.context_parallel import ContextParallel
from trainer.parallel.float8 import Float8Report, Float8ScalePrecompute, float8_step_hooks
from trainer.parallel.pipeline import Pipeline
from trainer.run.evaluate import Evaluator
from trainer.run.tasks import TaskScorer
from trainer.run.lock import check_writable, lock_run_folders, output_folders, release_all
from trainer.run.precision_schedule import PrecisionSchedule, free_memory, validate_run
from trainer.run.resume_check import ResumeCheck
from trainer.run.step import LossScaler, LossScalerPart, NonFiniteError, StepResult, TrainStep
from trainer.run.train_state import (
    PREEMPTED_MARKER, STOP_SIGNALS, Interval, StoppedBeforeFirstStep, TrainState, write_preempted,
)
from trainer.validate import ResolvedJob, validate_job
from trainer.validate.plan import human_size
from trainer.validate.ranks import agree_to_start, check_ranks_agree
from trainer.validate.run_files import (
    cpu_precision_hint, describe_documents, describe_precision, run_config, write_run_files,
)

logger = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """What `Trainer._build_model` makes."""

    model: nn.Module
    """This rank's model; under pp its stages as one module with the full model's fqns (trainer.parallel.pipeline)."""
    loss_fn: LossFn | None
    """The loss on the (last stage's) hidden states; None on pipeline ranks without the last stage."""
    float8: Float8Report | None
    cp: ContextParallel | None
    """This rank's chunks of every sequence under context parallelism, handed to the step."""
    pipeline: Pipeline | None


class Trainer:
    def __init__(self, job: ResolvedJob):
        """`job` is what `validate_job` resolved from the config (every user error is found before the process
        group exists): the Trainer reads nothing else. It trains to `job.run.stop_step` and saves there."""
        self.job, run = job, job.run
        start_compile_workers(compile=job.build.compile, device_type=run.device_type)
        self.parallel_dims, self.model_args = job.parallel_dims, job.model_args
        self.env: DistEnv = init_distributed(timeout_seconds=run.init_timeout_seconds)
        check_ranks_agree(job)  # before any model work: a rank with another job would train apart or hang the rest
        self.device = self.env.device
        assert self.device.type == run.device_type, (self.device, run.device_type)  # what validation resolved for
        set_determinism(seed=run.seed, deterministic=run.deterministic)
        self.parallel_dims.build_meshes(self.device.type)
        self.dp_mesh = self.parallel_dims.mesh("dp")
        logger.info("parallelism: %s on %s", self.parallel_dims.summary, describe_device(self.device))
        self.data_loader = build_data_loader(
            job.data_source, seed=run.data_seed, shuffle=run.data_shuffle, seq_len=run.seq_len,
            batch_size=run.batch_size, grad_accum_steps=run.grad_accum_steps, dp_rank=self.dp_mesh.get_local_rank(),
            dp_degree=self.parallel_dims.dp, eod_mask_id=run.eod_mask_id,
        )
        if documents := describe_documents(document_eos=job.build.document_eos, eod_mask_id=run.eod_mask_id):
            logger.info(documents)  # beside the data line: what the run does with a packed row's documents
        built = self._build_model(job)
        self.model, self.float8, self.loss_fn, self.pipeline = built.model, built.float8, built.loss_fn, built.pipeline
        self.optimizer, self.scheduler = self._build_optimizer(job)
        self._log_model()
        self.scaler = LossScaler(enabled=run.mixed_precision == "fp16", device=self.device)
        self.step_fn = TrainStep(
            model=self.model, loss_fn=self.loss_fn, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, max_norm=run.max_norm, fused=job.optimizer.fused, device=self.device,
            pipeline=built.pipeline, loss_context=self.loss_context, cp=built.cp,
            dp_cp_group=self.parallel_dims.mesh("dp_cp").get_group(),
        )
        self.events = EventLog(job.metrics.event_log, dump_folder=run.dump_folder, rank=self.env.rank,
                               device=self.device, layout=self.parallel_dims.layout, config=run_config(job.run_files))
        self.hooks = self._build_hooks(job) + self.events.hooks  # the event log last: its step ends after every hook
        self.state = TrainState(mixed_precision=run.mixed_precision, full_step_tokens=job.batch_warmup.full_tokens)
        self.stop_requested = False
        self.stepped = False  # a step of this process has finished: a stop signal now waits for the step's end
        self.steps_run = 0  # this process's steps (its skipped non-finite ones: metrics.num_nonfinite)
        self.checkpoint = self._build_checkpoint()
        self.checkpoint.save_events = self.events.checkpoint
        self.checkpoint.resume()  # overwrites the fresh state of every piece above
        self.resume_check.check(resumed_step=self.checkpoint.resumed_step)  # before step 1: the weights load as saved
        # After resume: a fresh run starts fresh metrics files, a resumed one continues them.
        m = job.metrics
        self.metrics = MetricsLogger(
            dump_folder=run.dump_folder, rank=self.env.rank, total_steps=run.steps,
            flops_per_token=flops_per_token(self.model_args, run.seq_len), peak_flops=device_peak_flops(self.device),
            device=self.device, enable_tensorboard=m.enable_tensorboard, enable_jsonl=m.enable_jsonl,
            loss_spike_factor=m.loss_spike_factor,
            fp8_converted_fraction=self.float8.converted_fraction if self.float8 else None,
            resumed_step=self.state.step, wandb=m.wandb,
            run_config=run_config(job.run_files) if m.wandb else None,
        )

    # -- building ------------------------------------------------------------

    def _build_model(self, job: ResolvedJob) -> BuiltModel:
        """This rank's model, parallelized, materialized and initialized (trainer.parallel.build), and its loss;
        under pp the pipeline builds this rank's stages with the same builder."""
        seed, build, args = job.run.seed, job.build, self.model_args

        def build_loss(last: nn.Module) -> LossFn:  # with MTP modules (DeepSeek-V3), their losses too
            return mtp_or_plain_loss_fn(last, args, chunk_tokens=build.loss_chunk_tokens, compile=build.compile_loss)

        if job.pipeline is not None:
            pipeline = Pipeline(self.model_args, self.parallel_dims, options=job.pipeline, build=build,
                                device=self.device, seed=seed, seq_len=job.run.seq_len // self.parallel_dims.cp,
                                build_loss=build_loss)
            return BuiltModel(model=pipeline.model, loss_fn=pipeline.loss_fn, float8=pipeline.float8_report,
                              cp=pipeline.cp, pipeline=pipeline)
        model, result = build_model_part(self.model_args, self.parallel_dims, options=build, device=self.device,
                                         seed=seed)
        return BuiltModel(model=model, loss_fn=build_loss(model), float8=result.float8, cp=result.cp, pipeline=None)

    def _build_optimizer(self, job: ResolvedJob):
        o, s = job.optimizer, job.scheduler
        optimizer = build_optimizer(
            self.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, dtypes=o.state_dtypes,
            rounding=o.rounding, implementation=o.implementation, seed=job.run.seed)
        scheduler = build_lr_scheduler(
            optimizer, warmup_steps=s.warmup_steps, total_steps=job.run.steps, decay_type=s.decay_type,
            min_lr_ratio=s.min_lr_ratio, wsd_decay_ratio=s.wsd_decay_ratio,
        )
        return optimizer, scheduler

    def _log_model(self) -> None:
        # The startup lines users check, in this order: Applied Float8 training (from
        # build_parallel_model), Optimizer groups and state, Model.
        logger.info("Optimizer groups: %s", describe_param_groups(self.optimizer, self.scheduler.schedule))
        logger.info("Optimizer state: %s", describe_optimizer_state(self.optimizer))
        args, job = self.model_args, self.job
        # From the shapes, not the model: under pp no rank holds the whole model (equal to num_params of the
        # whole model on every flavor: tests/unit/test_model.py).
        total, non_embedding = num_params_for(args)
        logger.info(
            "Model: %s, %s parameters (%s non-embedding), dim=%d, layers=%d, heads=%d/%d kv x %d, ffn=%d, vocab=%d%s",
            job.run.flavor, f"{total:,}", f"{non_embedding:,}", args.dim, args.n_layers, args.n_heads,
            args.n_kv_heads, args.head_dim, args.ffn_dim, args.vocab_size,
            "".join(f", {what}" for what, on in (("tied embeddings", args.tie_word_embeddings),
                                                 ("qk_norm", args.qk_norm)) if on),
        )
        if job.model_source:  # the shape is checkpoint.initial_load_path's
            logger.info(job.model_source)
        logger.info(describe_precision(mixed_precision=job.run.mixed_precision, bf16_update=job.optimizer.bf16_update,
                                       build=job.build, float8_layers=job.float8_layers))
        if job.fsdp_choices:
            logger.info(job.fsdp_choices)
        if hint := cpu_precision_hint(job.run.mixed_precision, self.device.type,
                                      fp8_unavailable=bool(job.build.float8 and job.build.float8.unavailable)):
            logger.info(hint)
        if (family_line := family_of(args).describe(args)) is not None:  # MoE: active parameters, routing
            logger.info(family_line)
        if (plan := job.memory_plan) is not None:
            logger.info("memory plan: about %s per rank at its peak (%s); `scripts/train.py ... --dry-run` "
                        "prints where it goes", human_size(plan.peak_bytes), plan.peak_at)

    def _build_hooks(self, job: ResolvedJob) -> list[StepHook]:
        """The per-step hooks (trainer/hooks.py) this job needs, in the order they run."""
        run, m, hooks = job.run, job.metrics, []
        if family_of(self.model_args).has_router:
            # Expert loads summed over every rank of the stage (ep ranks are dp ranks too; tp ranks route
            # slices of the same sequences); on every rank, since its collectives are (a pipeline rank may
            # hold no MoE layer).
            hooks.append(MoEBalancer(self.model, bias_update_rate=self.model_args.bias_update_rate,
                                     stage_group=self.parallel_dims.mesh("stage").get_group(),
                                     pp_group=self.pipeline.pp_group if self.pipeline else None))
        # Delayed scaling's amaxes: reduced over the ranks that compute the same layers (dp x cp of this stage).
        hooks += float8_step_hooks(self.model, self.float8, stats_freq=m.fp8_stats_freq, kurtosis_warn=m.kurtosis_warn,
                                   amax_group=self.parallel_dims.mesh("dp_cp").get_group())
        hooks += MixtureTokens.of(self.data_loader)  # a data mixture's tokens per source
        hooks += MTPLossMetrics.of(self.loss_fn, self.model_args, self.parallel_dims, device=self.device)  # per depth
        hooks += [ema] if (ema := EMAWeights.maybe(self.model, decay=run.ema_decay)) else []  # before an evaluation
        if ema:  # fp8 all-gather's scales follow the weights swapped in and out
            ema.after_swap = [h.refresh for h in hooks if isinstance(h, Float8ScalePrecompute)]
        if job.validation_source is not None:
            v = job.validation
            evaluator = Evaluator(
                job.validation_source, model=self.model, batch_loss=self.step_fn.eval_loss, seq_len=run.seq_len,
                batch_size=run.batch_size, steps=v.steps, freq=v.freq, last_step=run.steps,
                dp_rank=self.dp_mesh.get_local_rank(), dp_degree=self.parallel_dims.dp, device=self.device,
                dp_group=self.parallel_dims.mesh("dp_cp").get_group(), loss_context=self.loss_context,
                eod_mask_id=run.eod_mask_id, bf16_matmuls=self.float8 if v.bf16_matmuls else None, ema=ema,
            )
            logger.info("validation: %r, %d batches every %d steps (%s tokens each time)", job.validation_source,
                        v.steps, v.freq, f"{evaluator.tokens:,}")
            hooks += [evaluator, *TaskScorer.of(job.tasks, evaluator=evaluator, losses=self.step_fn.eval_row_losses)]
        return hooks

    def _build_checkpoint(self) -> CheckpointManager:
        job, pd = self.job, self.parallel_dims
        delayed = next((h for h in self.hooks if hasattr(h, "checkpoint_key")), None)  # float8.scaling='delayed'
        run = RunInfo(flavor=job.run.flavor, model_args=self.model_args, mixed_precision=job.run.mixed_precision,
                      layout=pd.layout, **job.run.tokenizer)
        self.resume_check = ResumeCheck(job, step_fn=self.step_fn, run=run,  # a probe loss recorded at each save
                                        cp_group=pd.mesh("cp").get_group() if pd.cp > 1 else None)
        parts = {"optimizer": OptimizerPart(self.model, self.optimizer), "lr_scheduler": SchedulerPart(self.scheduler),
                 "dataloader": DataPosition(self.data_loader, restart=job.checkpoint.restart_data),
                 "train_state": self.state, "loss_scaler": LossScalerPart(self.scaler, self.state), "rng": RngPart(),
                 "float8_scaling": DelayedScalingPart(delayed), "resume_check": self.resume_check,
                 "ema": EMAPart(next((h for h in self.hooks if isinstance(h, EMAWeights)), None))}  # in load order
        return CheckpointManager(job.checkpoint, state=CheckpointState(self.model, parts), run=run,
                                 timeout_seconds=job.run.init_timeout_seconds)

    # -- one step ------------------------------------------------------------

    def loss_context(self):
        if self.parallel_dims.tp > 1 and self.job.build.loss_parallel:
            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """The next optimizer step (trainer/run/step.py) with every hook around it, without a host sync.

        A non-finite step never reaches the weights (the fused optimizer skips it on the
        device, and the hooks mask their updates); `check_finite()` reports it on the host later.
        """
        step = self.state.step + 1
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.step_context(step))
            result = self.step_fn(microbatches, step, hooks=self.hooks)
        for hook in self.hooks:
            hook.after_optimizer_step(step, result.found_inf)
        return result

    def check_finite(self) -> int:
        """Report the non-finite steps since the last check (TrainStep.check_finite). note: a host sync."""
        return self.step_fn.check_finite(on_nonfinite=self.job.run.on_nonfinite,
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
        with self.events.recording(self.state, nonfinite=NonFiniteError):  # run_start, then the stop or error
            return self._run()

    def _run(self) -> TrainState:
        run, c = self.job.run, self.job.checkpoint
        Path(run.dump_folder).mkdir(parents=True, exist_ok=True)
        if self.env.rank == 0:
            written = write_run_files(run.dump_folder, self.job.run_files)
            logger.info("outputs: %s (%s, metrics.jsonl%s%s)", run.dump_folder, ", ".join(written),
                        ", tb/" if self.job.metrics.enable_tensorboard else "",
                        f", {c.folder}/ every {c.interval} steps" if c.enable else "")
            (Path(run.dump_folder) / PREEMPTED_MARKER).unlink(missing_ok=True)  # from a preempted earlier run
        previous = {sig: signal.signal(sig, self._request_stop) for sig in STOP_SIGNALS}
        p = self.job.profiling
        profiling = maybe_enable_profiling(
            enable=p.enable, start_step=p.start_step, end_step=p.end_step, trace_dir=p.trace_dir,
            rank=self.env.rank, record_shapes=p.record_shapes, with_stack=p.with_stack,
            profile_memory=p.profile_memory, expect_fp8=p.expect_fp8, on_summary=self.events.on_profile,
        )
        memory = maybe_record_memory_history(
            enable=p.memory_snapshot, snapshot_dir=str(Path(p.trace_dir) / "memory_snapshot"), rank=self.env.rank
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
        if self.steps_run and self.metrics.num_nonfinite >= self.steps_run:  # fp16 overflows are not counted
            raise NonFiniteError(  # not an exit 0: the run trained nothing
                f"every one of this run's {self.steps_run} steps had a non-finite loss or gradient and was skipped "
                "(train.on_nonfinite='skip'): nothing was trained; lower optimizer.lr or raise "
                "scheduler.warmup_steps, or check the data and the checkpoint it resumed (see docs/debug.md)")
        if self.state.preempted:
            self.checkpoint.wait()  # the stop's checkpoint is complete before we say so
            saved = self.checkpoint.last_saved_step == self.state.step
            what = f"checkpoint step-{self.state.step} saved" if saved else "no checkpoint saved (" + (
                "its save failed, see above" if self.checkpoint.enable else "checkpoint.enable=false") + ")"
            self.state.stopped_by = self.state.stopped_by or "SIGTERM"  # another rank's signal
            logger.warning("stopped by %s at step %d of %d; %s; exiting with code %d", self.state.stopped_by,
                           self.state.step, run.steps, what, self.state.exit_code)
            if self.env.rank == 0:
                write_preempted(run.dump_folder, step=self.state.step, of_steps=run.steps, saved=saved,
                                signal_name=self.state.stopped_by)
        elif run.stop_step == run.steps:  # not a job that stops before the run's last step (a precision phase)
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
            write_preempted(self.job.run.dump_folder, step=step, of_steps=self.job.run.steps, saved=saved,
                            signal_name=stop.signal_name)

    def _loop(self, profiler, memory_recorder) -> None:
        t, stop_step, ramp = self.job.run, self.job.run.stop_step, self.job.batch_warmup
        first_step = self.state.step + 1
        interval = Interval()
        logger.info("training steps %d-%d, %s; the first step includes %swarm-up", first_step, stop_step,
                    ramp.describe(), "compilation and " if t.compile_model else "")
        stopping, compiled_before = False, CompileTimes.now()
        while self.state.step < stop_step and not stopping:
            lr = self.scheduler.get_last_lr()[0]
            count = ramp.microbatches(self.state.tokens)  # train.batch_size_warmup_tokens' ramp, or grad_accum
            result = self.train_step(self.events.next_batch(self.data_loader, count))  # the event log times the fetch
            self.state.advance(ramp.step_tokens(count))
            self.stepped, self.steps_run = True, self.steps_run + 1
            step = self.state.step
            interval.add(self.state.step_tokens / self.env.world_size)  # per device (tp, pp ranks share dp's tokens)
            profiler.step(step)
            if step == self.job.profiling.end_step:
                memory_recorder.dump(f"step{step}")
            if (step == first_step or step % self.job.metrics.log_freq == 0 or step in (t.steps, stop_step)
                    or any(hook.log_due(step) for hook in self.hooks)):
                self._log(step, result, lr=lr, interval=interval, first_step=first_step)
                compiled = CompileTimes.now().since(compiled_before) if step == first_step else None
                if compiled is not None and (compiled.graphs or compiled.seconds):  # what a config change costs
                    logger.info("step %d done %.1f s after training started; %s", step,
                                time.perf_counter() - interval.start, compiled.describe())
                interval = Interval()
            stopping = self._agree_to_stop()
            # A stop at the last step is a completed run, not a preemption.
            self.state.preempted = stopping and step < t.steps
            # A job that stops before the run's end (a precision-schedule phase) saves like a stop: the next resumes it.
            self.checkpoint.maybe_save(step, final=step == t.steps, stopping=stopping or step == stop_step,
                                       before_save=self._before_save)

    def _before_save(self) -> None:
        """Right before a save: a run that must stop stops unsaved; then the probe loss the checkpoint records."""
        self.check_finite()
        self.resume_check.record()

    def _log(self, step: int, result: StepResult, *, lr: float, interval: Interval, first_step: int) -> None:
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
                      steps_in_interval=interval.steps, extra=extra, batch=self.state.batch), first_step=first_step)

    def close(self) -> None:
        try:
            self.checkpoint.close()  # a background save completes (or fails loudly) before exit
        finally:
            self.metrics.close()
            self.events.close()


def train(cfg: JobConfig) -> TrainState:
    """Validate, build everything, train, and always tear down (writers, process group)."""
    locks, trainer, ok = [], None, False
    try:
        try:  # the one validation pass, before the process group or any tensor exists
            schedule, job = validate_run(cfg, world_size=world_size_from_env())
            folders = {key: folder for folder, key in output_folders(cfg)}
            for key, folder in folders.items():
                check_writable(folder, key=key)
            check_run_files(cfg.job.dump_folder, wandb=cfg.metrics.wandb, markers=(PREEMPTED_MARKER,))
            if int(os.environ.get("RANK", "0")) == 0:  # global rank 0 owns the run's folders before any rank writes
                locks = lock_run_folders(cfg.job.dump_folder, folders.get("checkpoint.folder"))
            error = None
        except UserError as e:  # every rank hears of it before any stops; printed by the rank that found it
            schedule, job, error = None, None, e
        agree_to_start(error, timeout_seconds=cfg.distributed.init_timeout_seconds)
        if schedule:
            state = run_schedule(schedule)
        else:
            trainer = Trainer(job)
            state = trainer.run()
        ok = True
        return state
    finally:
        try:
            if trainer is not None:
                trainer.close()
            destroy_distributed(barrier=ok)
        finally:
            release_all(locks)


def run_schedule(schedule: PrecisionSchedule) -> TrainState:
    """Train the whole run phase by phase in this process, one Trainer per phase (each stops at its phase's last
    step and saves there; the next resumes it); returns the last phase's TrainState.

    A relaunch resumes the latest checkpoint and starts in the phase that holds the step after it.
    """
    resumed = schedule.start()
    k, load_step, relaunched = schedule.phase_of(resumed), -1, resumed > 0
    trainer = None
    # Process-wide switches a phase may flip, reset for each phase as a relaunch would: apply_float8 turns
    # oneDNN off on CPU (for torch._scaled_mm), which would change the matmuls of a later bf16 phase.
    mkldnn = torch.backends.mkldnn.enabled
    try:
        while True:
            torch.backends.mkldnn.enabled = mkldnn
            trainer = Trainer(schedule.job(k, load_step=load_step))
            resumed = trainer.state.step  # the same on every rank: rank 0 chose the checkpoint
            if schedule.phase_of(resumed) != k:
                # The newest checkpoint failed verification and an older one, from another phase, was loaded.
                logger.warning("precision schedule: resumed step %d, which is in phase %s, not %s: rebuilding",
                               resumed, schedule.phases[schedule.phase_of(resumed)], schedule.phases[k])
                trainer.close()
                trainer, k = None, schedule.phase_of(resumed)
                free_memory()
                continue
            if relaunched:
                logger.info("precision schedule: resuming at step %d in phase %d of %d (%s)", resumed, k + 1,
                            len(schedule.phases), schedule.phases[k])
                relaunched = False
            state = trainer.run()
            if state.preempted or state.step >= trainer.job.run.steps:
                return state
            assert state.step == trainer.job.run.stop_step, (state.step, trainer.job.run.stop_step)
            trainer.close()  # a background save of the boundary completes here
            saved = trainer.checkpoint.last_saved_step == state.step
            trainer = None
            k, load_step = k + 1, schedule.switch(k, saved=saved)
    finally:
        if trainer is not None:
            trainer.close()


def build_trainer(cfg: JobConfig) -> Trainer:
    """validate_job, then a Trainer of that job: for scripts and tests that start from one config."""
    return Trainer(validate_job(cfg, world_size=world_size_from_env()))
