"""The per-step hook protocol: work that hangs off the training step instead of being wired into the loop.

The loop (trainer/run/train.py) calls, for every hook, in this order around each optimizer step:

    with hook.step_context(step):              # around forward/backward/optimizer (FP8 health's eager hooks)
        ... forward/backward (trainer/run/step.py) ...
        hook.after_forward_backward(step)      # every step, never waits on the device
        ... the optimizer step ...
    hook.after_optimizer_step(step, found_inf)  # every step, never waits on the device
    hook.log_due(step)                          # True: this step gets a log line (evaluation, FP8 health)
    hook.on_log(step) -> {name: value}          # log steps only; may sync with the device

`found_inf` is the device tensor the step computed (True when the step was skipped: a
non-finite gradient norm, an fp16 overflow); a hook that changes state after the step
(the MoE expert biases) masks its change with it on the device instead of reading it.
Only `on_log` may move values to the host, so a step never waits for the GPU.

Implemented by: `trainer.models.moe.MoEBalancer` (expert-bias update, MoE metrics, aux
loss), `trainer.parallel.float8.Fp8HealthHook` (per-layer FP8 cast health),
`trainer.run.evaluate.Evaluator` (held-out loss), `trainer.run.tasks.TaskScorer` ([[validation.tasks]]' accuracy),
`trainer.parallel.float8.Float8ScalePrecompute` (fused weight-scale amax for fp8 all-gather),
`trainer.parallel.float8.weights_per_step.Fp8WeightsPerStep` (each FP8 weight cast once per step), `trainer.checkpoint.ema.EMAWeights` (train.ema_decay's average of
the weights), `trainer.metrics.events.EventLog` (metrics.event_log's step times; the last hook). This module imports nothing of the trainer, so
any room can implement the protocol.
"""

from __future__ import annotations

import contextlib

import torch


class StepHook:
    """Base class with no-op defaults; a hook overrides what it needs."""

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        """Entered around the forward/backward and optimizer step of `step` (1-based)."""
        return contextlib.nullcontext()

    def after_forward_backward(self, step: int) -> None:
        """Between the step's forward/backward and its optimizer step. Must not sync with the device."""

    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        """Right after the optimizer step (taken or skipped). Must not sync with the device."""

    def log_due(self, step: int) -> bool:
        """Whether this hook needs a log line at `step` (the loop also logs every metrics.log_freq steps)."""
        return False

    def on_log(self, step: int) -> dict[str, float]:
        """Scalars for the log line, metrics.jsonl and TensorBoard; called on every rank at log steps."""
        return {}
