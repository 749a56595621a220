"""FP8 routed experts (`float8.moe_experts`): each MoE layer's expert kernel switched to FP8 grouped GEMMs.

The kernel and its autograd live with the model (`trainer.models.moe_fp8.Fp8GroupedSwiGLU`); this room is the
experts' converter (`Fp8Experts`: where the kernel can run, installing it in every `GroupedExperts`, what it
did for the `Float8Report`) and the per-step weight cache's refresh (`Fp8ExpertWeightsRefresh`). The expert
weights' FP8 stats are in `trainer.parallel.float8.health`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Self

import torch
import torch.distributed as dist
from torch import nn

from trainer.hooks import StepHook
from trainer.models.layers import clean_fqn
from trainer.models.moe_experts import GroupedExperts, GroupedSwiGLU
from trainer.models.moe_fp8 import Fp8ExpertWeights, Fp8GroupedSwiGLU, Fp8RolesSwiGLU
from trainer.parallel.float8.hardware import fp8_grouped_supported, refuse_or_warn
from trainer.parallel.float8.report import Float8Converter

logger = logging.getLogger(__name__)


def experts_modules(model: nn.Module) -> dict[str, GroupedExperts]:
    """fqn -> GroupedExperts of every MoE layer."""
    return {clean_fqn(fqn): m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}


def fp8_experts_modules(model: nn.Module) -> dict[str, GroupedExperts]:
    """fqn -> GroupedExperts whose kernel the experts' converter switched to FP8."""
    return {fqn: m for fqn, m in experts_modules(model).items() if Fp8Experts.owns(m)}


@dataclass
class Fp8Experts(Float8Converter):
    """The routed experts' converter: every MoE layer's experts run as FP8 grouped GEMMs (float8.moe_experts).

    `per_step_weights`: keep the FP8 weights through the optimizer step (`trainer.models.moe_fp8.Fp8ExpertWeights`;
    trainer.validate decides). Where no FP8 grouped GEMM can run and nothing emulates it, the experts stay bf16
    with a loud warning, or `require` stops the run."""

    role: ClassVar[str] = "experts"
    mode: str
    emulate: bool = False
    require: bool = False
    per_step_weights: bool = False
    forward: str = "fp8"
    """float8.forward: 'bf16' runs the experts' forward GEMMs in bf16 (Fp8RolesSwiGLU)."""
    backward: str = "fp8"
    """float8.backward: 'bf16' gives the bf16 experts' gradients (Fp8RolesSwiGLU)."""
    num_layers: int = 0
    """MoE layers whose experts it converted (0: none here, or no FP8 grouped GEMM on this device)."""

    def convert(self, model: nn.Module, *, device: torch.device) -> None:
        """Install the FP8 kernel in every MoE layer and log the two lines that say so."""
        assert self.mode == "rowwise", self.mode  # trainer.validate checked it; "off" makes no converter
        experts = experts_modules(model)
        if not experts:  # a pipeline stage without MoE layers
            return
        ok, what = fp8_grouped_supported(device)
        if not ok and not self.emulate:
            refuse_or_warn(what, require=self.require, setting=f"float8.moe_experts='{self.mode}'",
                           headline="FP8 GROUPED GEMMS ARE UNAVAILABLE HERE",
                           instead=f"The routed experts train in BF16 instead (float8.moe_experts='{self.mode}').")
            return
        for module in experts.values():
            weights = Fp8ExpertWeights(per_step=self.per_step_weights)
            module.use(kernel=Fp8GroupedSwiGLU(weights, emulate=self.emulate) if self.forward == self.backward
                       else Fp8RolesSwiGLU(weights, emulate=self.emulate, forward=self.forward, backward=self.backward))
        self.num_layers = len(experts)
        logger.info(self.lines()[0])
        logger.info("FP8 grouped GEMMs: %s", "EMULATED in high precision (float8.emulate=true)" if self.emulate
                    else what)

    @classmethod
    def owns(cls, module: nn.Module) -> bool:
        return isinstance(module, GroupedExperts) and isinstance(module.kernel, Fp8GroupedSwiGLU)

    def in_bf16(self, module: nn.Module) -> Callable[[], None]:
        """The experts run torch's bf16 grouped GEMM (the same weights) until the undo puts the FP8 kernel back."""
        kernel = module.kernel
        module.use(kernel=GroupedSwiGLU())
        return lambda: module.use(kernel=kernel)

    def lines(self) -> list[str]:
        if not self.num_layers:
            return []
        weights = ("once per optimizer step and kept for its forwards" if self.per_step_weights
                   else "in each forward and backward, none kept")
        gemms = {("fp8", "fp8"): "forward and dgrad in e4m3, wgrad bf16",
                 ("fp8", "bf16"): "forward in e4m3; backward bf16, the bf16 experts' gradients from a bf16 recompute",
                 ("bf16", "fp8"): "forward bf16; dgrad in e4m3 and wgrad bf16 from an FP8 recompute in backward"}
        return [f"routed experts: FP8 {self.mode} grouped GEMM, layers.*.moe.experts.{{w1,w2,w3}} x{self.num_layers} "
                f"({gemms[self.forward, self.backward]}; tokens quantized once before the expert gather, weights "
                f"quantized {weights})"]

    @classmethod
    def merged(cls, stages: list[Self]) -> Self:
        return dataclasses.replace(stages[0], num_layers=sum(s.num_layers for s in stages))

    def step_hooks(self, model: nn.Module, *, amax_group: dist.ProcessGroup | None) -> list[StepHook]:
        """The per-step weight refresh, where this rank's experts keep their FP8 weights through the step."""
        refresh = Fp8ExpertWeightsRefresh(model)
        return [refresh] if any(cache.per_step for cache in refresh.caches) else []


class Fp8ExpertWeightsRefresh(StepHook):
    """The expert weights' FP8 copies live inside a step only: kept from its start, dropped once its forward/backward
    is done (the optimizer step's peak does not hold them, and the weights change), and closed between steps (an
    evaluation keeps nothing, reads nothing: float8.weights_per_step's rule); no device work."""

    def __init__(self, model: nn.Module):
        self.caches = [m.kernel.weights for m in fp8_experts_modules(model).values()]
        self.after_forward_backward(0)

    @contextlib.contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        for cache in self.caches:
            cache.invalidate()
            cache.open = True
        try:
            yield
        finally:
            self.after_forward_backward(step)

    def after_forward_backward(self, step: int) -> None:
        for cache in self.caches:
            cache.close()

    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        for cache in self.caches:
            cache.invalidate()
