"""FP8 training in one call: `apply_float8(model, options, *, device) -> Float8Report`, Linears and routed experts.

    options.py    Float8Options (made by the validation pass), the recipe and delayed scaling's settings
    apply.py      apply_float8: the converters the options ask for, run in order; fp8_layers.json's fields
    report.py     Float8Report: a list of converters (Float8Converter: one interface), merged over stages
    linear.py     which Linears convert, and the Linears' converters (tensorwise and rowwise; blockwise)
    blockwise.py  blockwise FP8 (1x128 / 128x128 scales): torchao's kernels as custom ops, and their emulation
    experts.py    the routed experts' converter: the FP8 grouped-GEMM kernel, installed in every MoE layer
    tensorwise.py our tensorwise Float8Linear (torchao's casts and _scaled_mm): delayed scaling, FP8 saved inputs
    delayed.py    delayed scaling's step hook: one all-reduce of the amaxes, the histories, the next scales
    weights_per_step.py  float8.weights_per_step's step hook: each weight cast once per step, reused by its microbatches
    hardware.py   can real FP8 kernels run here, and if not why (the one probe), and the loud answer when not
    hooks.py      the FP8 step hooks a run needs, from its report
    evaluation.py validation.mixed_precision='bf16': an fp8 model's matmuls in bf16 while it evaluates
    health.py     the FP8 stats: weights' amax and scale, activations' and gradients' underflow and saturation
    outliers.py   at the same steps, the kurtosis of each block's input across its channels (FOG's outlier metric)
"""

from trainer.parallel.float8.apply import apply_float8, float8_converters, fp8_layers_json
from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear
from trainer.parallel.float8.evaluation import bf16_matmuls
from trainer.parallel.float8.experts import Fp8Experts, Fp8ExpertWeightsRefresh, experts_modules
from trainer.parallel.float8.hardware import fp8_grouped_supported, fp8_supported, local_device
from trainer.parallel.float8.health import (Fp8HealthHook, Fp8HealthMonitor, float8_weight_stats,
                                            fp8_expert_weight_stats)
from trainer.parallel.float8.hooks import float8_step_hooks
from trainer.parallel.float8.linear import (BlockwiseLinears, Float8Linears, Float8ScalePrecompute, is_float8_linear,
                                            matches_exclusion, select_float8_linears)
from trainer.parallel.float8.options import DelayedScalingSettings, Float8Options, Recipe, resolve_format
from trainer.parallel.float8.report import Float8Converter, Float8Report, group_fqns

__all__ = [
    "BlockwiseFloat8Linear", "BlockwiseLinears", "DelayedScalingSettings", "Float8Converter", "Float8Linears",
    "Float8Options", "Float8Report", "Float8ScalePrecompute", "Fp8ExpertWeightsRefresh", "Fp8Experts",
    "Fp8HealthHook", "Fp8HealthMonitor", "Recipe", "apply_float8", "bf16_matmuls", "experts_modules",
    "float8_converters", "float8_step_hooks", "float8_weight_stats", "fp8_expert_weight_stats",
    "fp8_grouped_supported", "fp8_layers_json", "fp8_supported", "group_fqns", "is_float8_linear", "local_device",
    "matches_exclusion", "resolve_format", "select_float8_linears",
]
