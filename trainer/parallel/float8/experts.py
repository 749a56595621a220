"""FP8 routed experts (`float8.moe_experts`): each MoE layer's expert kernel switched to FP8 grouped GEMMs.

The kernel and its autograd live with the model (`trainer.models.moe_fp8.Fp8GroupedSwiGLU`); this room decides
where it can run, installs it in every `GroupedExperts` (`apply_fp8_experts`, which returns what it did for the
`Float8Report`) and refreshes the per-step weight cache (`Fp8ExpertWeightsRefresh`). The expert weights' FP8
stats are in `trainer.parallel.float8.health`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainer.hooks import StepHook
from trainer.parallel.float8.hardware import fp8_grouped_supported, refuse_or_warn
from trainer.parallel.float8.report import ExpertsConversion

logger = logging.getLogger(__name__)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """fqn -> GroupedExperts of every MoE layer."""
    from trainer.models.layers import clean_fqn
    from trainer.models.moe_experts import GroupedExperts

    return {clean_fqn(fqn): m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}


def fp8_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """fqn -> GroupedExperts whose kernel apply_fp8_experts switched to FP8."""
    from trainer.models.moe_fp8 import Fp8GroupedSwiGLU

    return {fqn: m for fqn, m in experts_modules(model).items() if isinstance(m.kernel, Fp8GroupedSwiGLU)}


def apply_fp8_experts(model: nn.Module, *, mode: str, emulate: bool, require: bool, device: torch.device,
                      per_step_weights: bool) -> ExpertsConversion | None:
    """Run every MoE layer's routed experts as FP8 grouped GEMMs, in place, and log the two lines that say so;
    returns what converted (the Float8Report's `experts`), or None where they stay bf16.

    `per_step_weights`: keep the FP8 weights through the optimizer step (`trainer.models.moe_fp8.Fp8ExpertWeights`;
    trainer.validate decides). Where no FP8 grouped GEMM can run and nothing
    emulates it, the experts stay bf16 with a loud warning, or `require` stops the run.
    """
    from trainer.models.moe_fp8 import Fp8ExpertWeights, Fp8GroupedSwiGLU

    assert mode in ("off", "rowwise"), mode  # trainer.validate checked it
    experts = experts_modules(model)
    if mode == "off" or not experts:
        return None
    ok, what = fp8_grouped_supported(device)
    if not ok and not emulate:
        refuse_or_warn(what, require=require, setting=f"float8.moe_experts='{mode}'",
                       headline="FP8 GROUPED GEMMS ARE UNAVAILABLE HERE",
                       instead=f"The routed experts train in BF16 instead (float8.moe_experts='{mode}').")
        return None
    for module in experts.values():
        module.use(kernel=Fp8GroupedSwiGLU(Fp8ExpertWeights(per_step=per_step_weights), emulate=emulate))
    conversion = ExpertsConversion(mode=mode, num_layers=len(experts), per_step_weights=per_step_weights)
    logger.info(conversion.line())
    logger.info("FP8 grouped GEMMs: %s", "EMULATED in high precision (float8.emulate=true)" if emulate else what)
    return conversion


class Fp8ExpertWeightsRefresh(StepHook):
    """After every optimizer step, drop the expert weights' FP8 copies (the weights changed); no device work."""

    def __init__(self, model: nn.Module):
        self.caches = [m.kernel.weights for m in fp8_experts_modules(model).values()]

    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        for cache in self.caches:
            cache.invalidate()
