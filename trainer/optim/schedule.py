"""The learning-rate schedule: warmup, then cosine, linear, WSD or constant; its startup words; its checkpoint part."""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch

logger = logging.getLogger("trainer.optim")


def lr_lambda(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_type: Literal["cosine", "linear", "wsd", "constant"],
    min_lr_ratio: float,
    wsd_decay_ratio: float,
) -> float:
    """LR multiplier for optimizer step `step` (0-based: the first step uses step=0).

    Warmup reaches the peak at step warmup_steps - 1, so step 0 already trains
    (lr = peak / warmup_steps) instead of wasting a step at lr 0.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_type == "constant":
        return 1.0
    if decay_type == "wsd":
        decay_steps = max(1, int(total_steps * wsd_decay_ratio))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - min_lr_ratio) * min(progress, 1.0)
    progress = min((step - warmup_steps) / max(1, total_steps - warmup_steps), 1.0)
    if decay_type == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# The config key of each argument of lr_lambda, for a resume that says what changed.
SCHEDULE_KEYS = {"warmup_steps": "scheduler.warmup_steps", "total_steps": "train.steps",
                 "decay_type": "scheduler.decay_type", "min_lr_ratio": "scheduler.min_lr_ratio",
                 "wsd_decay_ratio": "scheduler.wsd_decay_ratio"}


def build_lr_scheduler(optimizer: torch.optim.Optimizer, **schedule) -> torch.optim.lr_scheduler.LambdaLR:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_lambda(step, **schedule))
    scheduler.schedule = dict(schedule)  # saved with the scheduler's state (LambdaLR saves its attributes)
    return scheduler


def describe_schedule(peak_lr: float, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_ratio: float,
                      wsd_decay_ratio: float) -> str:
    """The learning rate as lr_lambda shapes it, in words: the peak (the configured optimizer.lr), then the phases.

    Step numbers are the log's (1-based): step k runs lr_lambda(k - 1).
    """
    parts = [f"lr {peak_lr:g} peak"]
    if warmup_steps > 0:
        short = f" (train.steps={total_steps} ends inside it)" if warmup_steps > total_steps else ""
        parts.append(f"warmup {warmup_steps} steps linear{short}")
    if warmup_steps >= total_steps:
        return ", ".join(parts)  # the run ends inside the warmup: the decay never starts
    low = f"{peak_lr * min_lr_ratio:g}"
    if decay_type == "constant":
        parts.append("then constant" if warmup_steps else "constant")
    elif decay_type == "wsd":
        decay_start = max(warmup_steps, total_steps - max(1, int(total_steps * wsd_decay_ratio)))
        parts.append(f"constant to step {decay_start}, then linear decay to {low} over steps "
                     f"{decay_start + 1}-{total_steps}")
    else:
        parts.append(f"{decay_type} decay to {low} over steps {warmup_steps + 1}-{total_steps}")
    return ", ".join(parts)


class SchedulerPart:
    """The schedule's part of a checkpoint (trainer/checkpoint/parts.py): LambdaLR's position and the schedule's
    arguments (`build_lr_scheduler` keeps them as `schedule`, which LambdaLR saves with its attributes). On resume
    the position is the checkpoint's and the schedule this run's (a cooldown relaunch may change it): the next lr
    comes from this run's schedule at the saved position, with a warning naming the keys when it differs."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        s = self.scheduler
        config_base_lrs = list(s.base_lrs)
        saved_lr = saved.get("_last_lr")
        saved = dict(saved)
        saved_schedule, schedule = saved.pop("schedule", None), getattr(s, "schedule", None)
        s.load_state_dict({**saved, "base_lrs": config_base_lrs})
        # The lr of the next step from this run's schedule at the saved position; the same
        # expression LambdaLR uses, so an unchanged config gives the bit-identical lr.
        lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs
        if saved_lr is not None and list(saved_lr) != lrs:
            logger.warning("learning rate at step %d is %.3e from this run's schedule (the checkpoint's run had "
                           "%.3e): %s", s.last_epoch, lrs[0], saved_lr[0],
                           _schedule_changes(saved_schedule, schedule, saved.get("base_lrs"), config_base_lrs))


def _schedule_changes(saved: dict | None, now: dict | None, saved_lrs: list | None, lrs: list) -> str:
    """What differs between the checkpoint's schedule and this run's, by config key."""
    if saved is None or now is None:  # a checkpoint from before schedules were saved
        return "optimizer/scheduler settings changed"
    changed = [f"{SCHEDULE_KEYS.get(k, k)} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v]
    if saved_lrs is not None and list(saved_lrs) != list(lrs):
        changed.append(f"optimizer.lr {saved_lrs[0]:g} -> {lrs[0]:g}")
    return ", ".join(changed) or "optimizer/scheduler settings changed"
