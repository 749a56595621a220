"""FP8 in one call: `apply_float8(model, options, *, device)` runs the converters the options ask for, in order, and
returns their report.

    the Linears    float8.recipe: tensorwise, rowwise, rowwise_with_gw_hp, blockwise (linear.py)
    the experts    float8.moe_experts='rowwise': FP8 grouped GEMMs in every MoE layer (experts.py)

A new quantization (MX, NVFP4) is one more converter (report.py's `Float8Converter`) named here.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.parallel.float8.experts import Fp8Experts
from trainer.parallel.float8.linear import BlockwiseLinears, Float8Linears
from trainer.parallel.float8.options import Float8Options
from trainer.parallel.float8.report import Float8Converter, Float8Report

# The Linears' converter of each float8.recipe.
LINEAR_CONVERTERS: dict[str, type[Float8Linears]] = {
    "tensorwise": Float8Linears, "rowwise": Float8Linears, "rowwise_with_gw_hp": Float8Linears,
    "blockwise": BlockwiseLinears,
}


def float8_converters(options: Float8Options) -> list[Float8Converter]:
    """The converters `options` asks for, in the order they run: the Linears', then the routed experts'."""
    converters: list[Float8Converter] = [LINEAR_CONVERTERS[options.recipe](options)]
    if options.moe_experts != "off":
        converters.append(Fp8Experts(mode=options.moe_experts, emulate=options.emulate, require=options.require,
                                     per_step_weights=options.expert_weights_per_step, forward=options.forward,
                                     backward=options.backward))
    return converters


def apply_float8(model: nn.Module, options: Float8Options, *, device: torch.device) -> Float8Report:
    """Convert `model` in place, Linears and routed experts, as `options` says; each converter logs what it did.

    Runs after EP and before activation checkpointing, torch.compile and FSDP2 (trainer.parallel.apply)."""
    report = Float8Report(float8_converters(options))
    for converter in report.converters:
        converter.convert(model, device=device)
    return report


def fp8_layers_json(options: Float8Options, layers: dict[str, str]) -> dict:
    """fp8_layers.json (trainer/validate/run_files.py): each converter's part (the Linears': recipe, format,
    scaling), then every Linear's fate (`layers`: fqn -> "converted" or why not, from the validation pass)."""
    fields: dict = {}
    for converter in float8_converters(options):
        fields |= converter.fp8_layers_fields()
    return fields | {"layers": layers}
