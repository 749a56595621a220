"""FP8 Linears through torchao (tensorwise, rowwise) or our blockwise module: which convert, and proof that they did.

FP8 is a compute dtype only: weights stay bf16/fp32 in the model and optimizer;
torchao's Float8Linear casts inputs, weights and gradients to float8 with dynamic
scales right before each matmul (`torch._scaled_mm`). The blockwise recipe swaps in
`trainer.parallel.float8.blockwise.BlockwiseFloat8Linear` instead (torchao's blockwise
autograd function, or its plain-torch emulation).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import torch
from torch import nn

from trainer.hooks import StepHook
from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear, convert_to_blockwise
from trainer.parallel.float8.hardware import fp8_supported, refuse_or_warn
from trainer.parallel.float8.options import DelayedScalingSettings, Recipe, resolve_format
from trainer.parallel.float8.report import Float8Report

logger = logging.getLogger(__name__)

# For scripts/benchmark.py --own-fp8-linear only: run our Float8TensorwiseLinear even with dynamic scaling and bf16
# saved inputs, to time it against torchao's Float8Linear (the same numerics). Not a config key.
OWN_TENSORWISE_LINEAR = False

# Blockwise scales cover 1x128 tiles and 128x128 blocks: both GEMM dims of a converted Linear must be multiples.
BLOCKWISE_EXCLUDED = "dims not multiples of 128 (blockwise)"

# Converted: attention and dense-MLP projections, and the output head.
_CONVERT = re.compile(r"(^|\.)(attention\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj|output_head\.proj)$")
# Never converted, even when the pattern above matches, with the reason the log line gives:
# the router (tiny, and routing decisions are sensitive to precision), shared experts (small
# GEMMs next to the routed ones; kept bf16 like the routed experts until measured to pay) and
# routed experts (3-D weights run by a grouped GEMM, not nn.Linear; listed for models that
# hold them as Linears).
_ALWAYS_EXCLUDED = [
    (re.compile(r"(^|\.)(router|gate_router)(\.|$)"), "MoE router"),
    (re.compile(r"(^|\.)shared_experts?(\.|$)"), "MoE shared expert"),
    (re.compile(r"(^|\.)experts(\.|$)"), "MoE routed expert"),
]


def select_float8_linears(
    model: nn.Module, *, exclude_fqns: list[str], recipe: Recipe = "tensorwise"
) -> tuple[list[str], dict[str, str], int]:
    """Decide which Linear fqns convert. Returns (converted, excluded {fqn: reason}, num_linear).

    An exclude_fqns entry matches a Linear whose fqn equals it or contains it as a
    dotted component run (e.g. "output_head.proj" or "layers.0.mlp"); an entry
    matching nothing is an error, so a typo never silently leaves a layer in FP8.
    The blockwise recipe also leaves out Linears with a dim that is not a multiple of 128.
    """
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    unmatched = [e for e in exclude_fqns if not any(matches_exclusion(fqn, e) for fqn in linears)]
    if unmatched:
        raise ValueError(
            f"float8.exclude_fqns entry {unmatched[0]!r} matches no Linear layer "
            f"(Linear fqns look like {next(iter(linears), 'none')!r})"
        )
    converted, excluded = [], {}
    for fqn, mod in linears.items():
        always = next((reason for pattern, reason in _ALWAYS_EXCLUDED if pattern.search(fqn)), None)
        if always:
            excluded[fqn] = always
        elif any(matches_exclusion(fqn, e) for e in exclude_fqns):
            excluded[fqn] = "float8.exclude_fqns"
        elif not _CONVERT.search(fqn):
            excluded[fqn] = "not a converted projection"
        elif mod.in_features % 16 or mod.out_features % 16:
            # torch._scaled_mm needs both GEMM dims divisible by 16.
            excluded[fqn] = f"shape {mod.in_features}x{mod.out_features} not divisible by 16"
        elif recipe == "blockwise" and (mod.in_features % 128 or mod.out_features % 128):
            excluded[fqn] = f"shape {mod.in_features}x{mod.out_features}: {BLOCKWISE_EXCLUDED}"
        else:
            converted.append(fqn)
    return converted, excluded, len(linears)


def matches_exclusion(fqn: str, entry: str) -> bool:
    """Whether a float8.exclude_fqns entry names this fqn (equal, or a run of its dotted components)."""
    return fqn == entry or f".{entry}." in f".{fqn}."


def apply_float8(
    model: nn.Module,
    *,
    recipe: Recipe,
    enable_fsdp_float8_all_gather: bool,
    exclude_fqns: list[str],
    emulate: bool,
    require: bool,
    device: torch.device,
    moe_experts: str = "off",
    fp8_format: str | None = None,
    delayed: DelayedScalingSettings | None = None,
    save_fp8_activations: bool = False,
) -> Float8Report:
    """Swap the selected nn.Linear modules for torchao Float8Linear (blockwise: BlockwiseFloat8Linear), in place.

    Must run after EP and before activation checkpointing, torch.compile and FSDP2, which wrap
    whatever modules they find; never after TP (the config check refuses FP8 + TP). Logs the two
    confirmation lines. Tensorwise with `delayed` (float8.scaling='delayed') or `save_fp8_activations` runs our
    Float8TensorwiseLinear (trainer.parallel.float8.tensorwise) instead of torchao's. When the GPU has no FP8 tensor cores it warns loudly and converts nothing
    (bf16 runs), or raises if `require`.
    """
    from torch.distributed.tensor import DTensor

    tp = next((fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and isinstance(m.weight, DTensor)),
              None)
    assert tp is None, f"{tp}.weight is a tensor-parallel DTensor: JobConfig refuses FP8 + tensor parallelism"

    # The config check refuses it: blockwise weights are all-gathered in bf16.
    assert not (enable_fsdp_float8_all_gather and recipe == "blockwise"), "blockwise has no fp8 all-gather"
    fp8_format = fp8_format or resolve_format(recipe)  # None: float8.format='auto'
    assert fp8_format == "e4m3" or recipe == "tensorwise", (recipe, fp8_format)  # the config check refuses it
    assert recipe == "tensorwise" or (delayed is None and not save_fp8_activations), recipe  # the config check
    report = Float8Report(recipe=recipe, fsdp_float8_all_gather=enable_fsdp_float8_all_gather, emulate=emulate,
                          format=fp8_format, delayed=delayed, save_fp8_activations=save_fp8_activations)
    converted, excluded, num_linear = select_float8_linears(model, exclude_fqns=exclude_fqns, recipe=recipe)
    report.excluded, report.num_linear = excluded, num_linear

    ok, what = fp8_supported(device, recipe)
    if not ok and not emulate:
        refuse_or_warn(what, require=require, setting="train.mixed_precision='fp8'",
                       headline=f"FP8 IS UNAVAILABLE ON THIS {'GPU' if device.type == 'cuda' else 'DEVICE'}",
                       instead="This run trains in BF16 instead.")
        return report
    _convert(model, set(converted), recipe=recipe, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather,
             emulate=emulate, device=device, fp8_format=fp8_format)
    if recipe == "tensorwise" and (delayed is not None or save_fp8_activations or OWN_TENSORWISE_LINEAR):
        from trainer.parallel.float8.tensorwise import convert_to_tensorwise  # imports torchao

        convert_to_tensorwise(model, delayed=delayed is not None, save_fp8_input=save_fp8_activations)
    report.converted = converted
    _log_conversion(model, report, what, moe_experts=moe_experts)
    return report


def _convert(model: nn.Module, selected: set[str], *, recipe: Recipe, enable_fsdp_float8_all_gather: bool,
             emulate: bool, device: torch.device, fp8_format: str = "hybrid") -> None:
    """Swap the selected Linears: BlockwiseFloat8Linear for blockwise, torchao's Float8Linear otherwise.
    fp8_format "e4m3" casts the tensorwise recipe's gradients to e4m3 too (torchao's default is e5m2)."""
    if recipe == "blockwise":
        convert_to_blockwise(model, selected, emulate=emulate)
        return

    from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import e4m3_dtype

    if recipe == "tensorwise":
        grads = {"cast_config_grad_output": CastConfig(target_dtype=e4m3_dtype)} if fp8_format == "e4m3" else {}
        config = Float8LinearConfig(
            enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather, emulate=emulate, **grads
        )
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    if device.type == "cpu" and not emulate and torch.backends.mkldnn.enabled:
        # oneDNN's fp8 GEMM on CPUs without AMX-FP8 is a reference loop, ~100x slower
        # than aten's own CPU _scaled_mm (same results; measured 0.9 s vs 0.01 s for
        # 1024x128x384). Disabling oneDNN routes torch._scaled_mm to aten's kernel.
        torch.backends.mkldnn.enabled = False
        logger.info("float8 on CPU: oneDNN disabled so torch._scaled_mm uses aten's CPU kernel")
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in selected, config=config)


def _log_conversion(model: nn.Module, report: Float8Report, what: str, *, moe_experts: str) -> None:
    """The confirmation lines: what converted, what stayed bf16 and why, and what runs the matmuls."""
    from trainer.models.layers import clean_fqn

    for line in report.lines():
        logger.info(line)
    n = sum(1 for fqn, _ in model.named_parameters() if clean_fqn(fqn).endswith(".moe.experts.w1"))
    if n and moe_experts == "off":  # otherwise trainer.parallel.float8.experts says what they run
        logger.info("MoE routed experts stay bf16: layers.*.moe.experts.{w1,w2,w3} x%d (grouped GEMM on 3-D "
                    "weights; float8.moe_experts='rowwise' runs them as FP8 grouped GEMMs)", n)
    if not report.emulate:
        logger.info("float8 matmuls: %s", what)
    elif report.recipe == "blockwise":
        logger.info("float8 matmuls: EMULATED in plain torch (blockwise 1x128 / 128x128 e4m3 quantize-dequantize, "
                    "fp32 matmuls; float8.emulate=true)")
    else:
        logger.info("float8 matmuls: EMULATED in high precision (float8.emulate=true)")


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step with fp8 all-gather: one fused amax over all weights.

    Without it every Float8Linear computes its weight's scale separately inside the
    all-gather (one small all-reduce per layer).
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


class Float8ScalePrecompute(StepHook):
    """The step hook of fp8 all-gather: after every optimizer step, the weights' float8 scales in one fused
    amax and one all-reduce (`precompute_float8_scales`), before the next forward gathers them."""

    def __init__(self, model: nn.Module):
        self.model = model

    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        precompute_float8_scales(self.model)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether apply_float8 converted this module (torchao's Float8Linear or a BlockwiseFloat8Linear)."""
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, (Float8Linear, BlockwiseFloat8Linear))
