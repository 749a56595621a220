"""FP8 routed experts (`float8.moe_experts`): switch each MoE layer's grouped GEMMs to FP8, and say so.

The kernels and their autograd live with the model (`trainer/models/moe_fp8.py`); this room decides
where they can run, installs them (`apply_fp8_experts`), refreshes the per-step weight cache
(`Fp8ExpertWeightsRefresh`) and reports the expert weights' FP8 health (`fp8_expert_weight_stats`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainer.hooks import StepHook

logger = logging.getLogger(__name__)



def fp8_grouped_supported(device: torch.device) -> tuple[bool, str]:
    """Whether torch._scaled_grouped_mm (rowwise e4m3) runs on this device, and what runs."""
    if device.type != "cuda":
        return False, f"torch._scaled_grouped_mm has no {device.type.upper()} kernel"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) != (9, 0):
        # torch's rowwise FP8 grouped GEMM is a CUTLASS sm90 kernel; other GPUs get MXFP8 or nothing.
        return False, f"{name} (compute capability {major}.{minor}): torch's rowwise FP8 grouped GEMM needs sm90"
    return True, f"{name}: torch._scaled_grouped_mm"


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """fqn -> GroupedExperts of every MoE layer."""
    from trainer.models.layers import clean_fqn
    from trainer.models.moe import GroupedExperts

    return {clean_fqn(fqn): m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}


def apply_fp8_experts(model: nn.Module, *, mode: str, emulate: bool, require: bool, device: torch.device,
                      per_step_weights: bool) -> list[str]:
    """Run every MoE layer's routed experts as FP8 grouped GEMMs, in place; returns the lines it logged.

    `per_step_weights`: keep the FP8 weights through the optimizer step (`trainer.models.moe_fp8.Fp8ExpertWeights`;
    trainer.validate decides). Where no FP8 grouped GEMM can run and nothing
    emulates it, the experts stay bf16 with a loud warning, or `require` stops the run.
    """
    from trainer.models.moe_fp8 import Fp8ExpertWeights

    assert mode in ("off", "rowwise"), mode  # trainer.validate checked it
    experts = experts_modules(model)
    if mode == "off" or not experts:
        return []
    ok, what = fp8_grouped_supported(device)
    if not ok and not emulate:
        if require:
            raise ValueError(f"float8.moe_experts='{mode}' but {what}; float8.require=true, so stopping")
        banner = "!" * 100
        logger.warning("\n%s\nFP8 GROUPED GEMMS ARE UNAVAILABLE HERE: %s.\nThe routed experts train in BF16 "
                       "instead (float8.moe_experts='%s'). Set float8.require=true to fail instead.\n%s",
                       banner, what, mode, banner)
        return []
    for module in experts.values():
        module.fp8 = Fp8ExpertWeights(per_step=per_step_weights)
        module.fp8_emulate = emulate
    weights = ("once per optimizer step and kept for its forwards" if per_step_weights
               else "in each forward and backward, none kept")
    lines = [
        f"routed experts: FP8 {mode} grouped GEMM, layers.*.moe.experts.{{w1,w2,w3}} x{len(experts)} "
        f"(forward and dgrad in e4m3, wgrad bf16; tokens quantized once before the expert gather, weights "
        f"quantized {weights})",
        f"FP8 grouped GEMMs: {'EMULATED in high precision (float8.emulate=true)' if emulate else what}",
    ]
    for line in lines:
        logger.info(line)
    return lines


class Fp8ExpertWeightsRefresh(StepHook):
    """After every optimizer step, drop the expert weights' FP8 copies (the weights changed); no device work."""

    def __init__(self, model: nn.Module):
        self.caches = [m.fp8 for m in experts_modules(model).values() if m.fp8 is not None]

    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        for cache in self.caches:
            cache.invalidate()


def fp8_expert_weight_stats(model: nn.Module) -> dict[str, float]:
    """Per FP8 expert weight: amax over the whole (global) tensor and E4M3_MAX / amax, the scale its largest row
    gets before rounding down to a power of two (the smallest of its rowwise scales). Host syncs: log steps."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.models.moe_fp8 import E4M3_MAX

    stats: dict[str, float] = {}
    for fqn, module in experts_modules(model).items():
        if module.fp8 is None:
            continue
        for name in ("w1", "w2", "w3"):
            weight = getattr(module, name)
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            amax = local.detach().abs().amax().float() if local.numel() else torch.zeros((), device=local.device)
            if isinstance(weight, DTensor):  # EP and FSDP shards: the max over every rank holding a piece
                for dim in range(weight.device_mesh.ndim):
                    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=weight.device_mesh.get_group(dim))
            value = amax.item()
            stats[f"fp8/weight_amax/{fqn}.{name}"] = value
            stats[f"fp8/weight_scale/{fqn}.{name}"] = E4M3_MAX / max(value, 1e-12)
    return stats
