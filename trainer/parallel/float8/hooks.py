"""The step hooks an FP8 run needs (trainer/hooks.py), in the order they run after each optimizer step."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from trainer.hooks import StepHook
from trainer.parallel.float8.experts import Fp8ExpertWeightsRefresh
from trainer.parallel.float8.health import Fp8HealthHook
from trainer.parallel.float8.linear import Float8ScalePrecompute
from trainer.parallel.float8.report import Float8Report


def float8_step_hooks(model: nn.Module, report: Float8Report | None, *, stats_freq: int,
                      amax_group: dist.ProcessGroup | None) -> list[StepHook]:
    """The FP8 experts' per-step weight refresh, fp8 all-gather's weight-scale precompute, delayed scaling (its
    amaxes reduced over `amax_group`: the data- and context-parallel ranks of this pipeline stage) and the health
    stats (every `stats_freq` steps; 0 = off), each where this run uses it."""
    hooks: list[StepHook] = []
    refresh = Fp8ExpertWeightsRefresh(model)
    if any(cache.per_step for cache in refresh.caches):  # FP8 experts' weights: quantized once per step
        hooks.append(refresh)
    if not (report and report.enabled):
        return hooks
    if report.fsdp_float8_all_gather:
        hooks.append(Float8ScalePrecompute(model))
    if report.delayed is not None:
        from trainer.parallel.float8.delayed import DelayedScaling  # imports torchao

        d = report.delayed
        hooks.append(DelayedScaling(model, history_len=d.amax_history_len, algo=d.amax_compute_algo,
                                    margin=d.margin, group=amax_group))
    if stats_freq:
        hooks.append(Fp8HealthHook(model, recipe=report.recipe, every=stats_freq))
    return hooks
