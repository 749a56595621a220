"""The step hooks an FP8 run needs (trainer/hooks.py), taken from its report, in the order they run after each
optimizer step."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from trainer.hooks import StepHook
from trainer.parallel.float8.health import Fp8HealthHook
from trainer.parallel.float8.report import Float8Report


def float8_step_hooks(model: nn.Module, report: Float8Report | None, *, stats_freq: int,
                      amax_group: dist.ProcessGroup | None, kurtosis_warn: float = 0.0) -> list[StepHook]:
    """Every converter's hooks (the Linears': fp8 all-gather's weight-scale precompute and delayed scaling, its
    amaxes reduced over `amax_group`: the data- and context-parallel ranks of this pipeline stage; the experts':
    the per-step weight refresh), then the health stats (every `stats_freq` steps; 0 = off) where some Linear
    runs in FP8, with the blocks' input kurtosis (a warning above `kurtosis_warn`; 0 = none)."""
    if report is None:
        return []
    hooks = [hook for converter in report.converters for hook in converter.step_hooks(model, amax_group=amax_group)]
    if stats_freq and report.enabled:
        hooks.append(Fp8HealthHook(model, recipe=report.linears.options.recipe, every=stats_freq,
                                   kurtosis_warn=kurtosis_warn))
    return hooks
