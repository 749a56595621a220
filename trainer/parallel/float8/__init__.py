"""FP8 training: dense Linears (torchao tensorwise / rowwise, our blockwise), routed experts, health, one report.

    hardware.py   can real FP8 kernels run here, and if not why (the one probe), and the loud answer when not
    linear.py     which Linears convert and the conversion (torchao's Float8Linear, or blockwise.py's module)
    blockwise.py  blockwise FP8 (1x128 / 128x128 scales): torchao's kernels as custom ops, and their emulation
    experts.py    the routed experts' FP8 grouped-GEMM kernel, installed in every MoE layer
    tensorwise.py our tensorwise Float8Linear (torchao's casts and _scaled_mm): delayed scaling, FP8 saved inputs
    delayed.py    delayed scaling's step hook: one all-reduce of the amaxes, the histories, the next scales
    hooks.py      the FP8 step hooks a run needs
    options.py    Float8Options (made by the validation pass), the recipe and delayed scaling's settings
    report.py     Float8Report: what converted (Linears and experts), logged at build and merged over stages
    evaluation.py validation.mixed_precision='bf16': an fp8 model's matmuls in bf16 while it evaluates
    health.py     the FP8 stats: weights' amax and scale, activations' and gradients' underflow and saturation

The build calls `apply_float8`, then `apply_fp8_experts`, whose result joins the report
(`trainer.parallel.build`).
"""

from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear
from trainer.parallel.float8.evaluation import bf16_matmuls
from trainer.parallel.float8.experts import Fp8ExpertWeightsRefresh, apply_fp8_experts, experts_modules
from trainer.parallel.float8.hardware import fp8_grouped_supported, fp8_supported, local_device
from trainer.parallel.float8.health import (Fp8HealthHook, Fp8HealthMonitor, float8_weight_stats,
                                            fp8_expert_weight_stats)
from trainer.parallel.float8.linear import (Float8ScalePrecompute, apply_float8, is_float8_linear, matches_exclusion,
                                            select_float8_linears)
from trainer.parallel.float8.hooks import float8_step_hooks
from trainer.parallel.float8.options import DelayedScalingSettings, Float8Options, Recipe, resolve_format
from trainer.parallel.float8.report import ExpertsConversion, Float8Report, group_fqns, merge_reports

__all__ = [
    "BlockwiseFloat8Linear", "DelayedScalingSettings", "ExpertsConversion", "Float8Options", "Float8Report",
    "Float8ScalePrecompute",
    "Fp8ExpertWeightsRefresh", "Fp8HealthHook", "Fp8HealthMonitor", "Recipe", "apply_float8", "apply_fp8_experts",
    "bf16_matmuls", "experts_modules", "float8_step_hooks",
    "float8_weight_stats", "fp8_expert_weight_stats", "fp8_grouped_supported", "fp8_supported", "group_fqns",
    "is_float8_linear", "local_device", "matches_exclusion", "merge_reports", "resolve_format", "select_float8_linears",
]
