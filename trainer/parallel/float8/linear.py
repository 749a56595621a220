"""FP8 Linears: which convert (`select_float8_linears`, also the validation pass's), and the Linears' converters:
`Float8Linears` for the torchao recipes (tensorwise, rowwise), `BlockwiseLinears` for blockwise (blockwise.py's module).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.hooks import StepHook
from trainer.models.layers import clean_fqn
from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear, convert_to_blockwise
from trainer.parallel.float8.hardware import fp8_supported, refuse_or_warn
from trainer.parallel.float8.options import DelayedScalingSettings, Float8Options, Recipe, describe_roles
from trainer.parallel.float8.report import Float8Converter, group_fqns

logger = logging.getLogger(__name__)

# For scripts/benchmark.py --own-fp8-linear only: run our Float8TensorwiseLinear even with dynamic scaling and bf16
# saved inputs, to time it against torchao's Float8Linear (the same numerics). Not a config key.
OWN_TENSORWISE_LINEAR = False

# Blockwise scales cover 1x128 tiles and 128x128 blocks: both GEMM dims of a converted Linear must be multiples.
BLOCKWISE_EXCLUDED = "dims not multiples of 128 (blockwise)"

# Converted: attention and dense-MLP projections, and the output head. DeepSeek-V3's MLA projections are plain Linears
# and all convert, as DeepSeek-V3 trained every GEMM but the embedding, head, gating, norms and attention core in FP8
# (its section 3.3): q_proj (or q_a_proj -> q_b_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj, and an MTP module's
# eh_proj. Their low-rank widths decide: a q_lora_rank, kv_lora_rank + qk_rope_head_dim or kv_lora_rank that is not a
# multiple of 16 keeps that GEMM bf16 (the shape rule below; 128 under blockwise: kv_a's 512 + 64 = 576 stays bf16
# there). The latents' norms, the shared RoPE key and the attention core are no Linears.
_CONVERT = re.compile(r"(^|\.)(attention\.(q|k|v|o|q_a|q_b|kv_b)_proj|attention\.kv_a_proj_with_mqa|"
                      r"mlp\.(gate|up|down)_proj|eh_proj|output_head\.proj)$")
# Never converted, even when the pattern above matches, with the reason the log line gives:
# the router (tiny, and routing decisions are sensitive to precision), shared experts (small
# GEMMs next to the routed ones; kept bf16 like the routed experts until measured to pay) and
# routed experts (3-D weights run by a grouped GEMM, not nn.Linear; listed for models that
# hold them as Linears).
# A transformer block's Linear: layers.<global index>. (pipeline stages keep the whole model's block names).
_BLOCK = re.compile(r"^layers\.(\d+)\.")
_ALWAYS_EXCLUDED = [
    (re.compile(r"(^|\.)(router|gate_router)(\.|$)"), "MoE router"),
    (re.compile(r"(^|\.)shared_experts?(\.|$)"), "MoE shared expert"),
    (re.compile(r"(^|\.)experts(\.|$)"), "MoE routed expert"),
]


def select_float8_linears(
    model: nn.Module, *, exclude_fqns: list[str], recipe: Recipe = "tensorwise",
    bf16_blocks: dict[int, str] | None = None,
) -> tuple[list[str], dict[str, str], int]:
    """Decide which Linear fqns convert. Returns (converted, excluded {fqn: reason}, num_linear).

    An exclude_fqns entry matches a Linear whose fqn equals it or contains it as a run of
    whole dotted segments (e.g. "output_head.proj" or "layers.0.mlp"; not "layers.0." nor
    "up_pro"); an entry matching nothing is an error, so a typo never silently leaves a layer in FP8.
    `bf16_blocks` (global block index -> why) keeps every Linear of those blocks bf16 with that reason.
    The blockwise recipe also leaves out Linears with a dim that is not a multiple of 128.
    """
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    _check_exclusions(exclude_fqns, list(linears))
    converted, excluded = [], {}
    for fqn, mod in linears.items():
        always = next((reason for pattern, reason in _ALWAYS_EXCLUDED if pattern.search(fqn)), None)
        block = _BLOCK.match(fqn)
        if always:
            excluded[fqn] = always
        elif block and int(block.group(1)) in (bf16_blocks or {}):
            excluded[fqn] = bf16_blocks[int(block.group(1))]
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


def _check_exclusions(exclude_fqns: list[str], linears: list[str]) -> None:
    """Every float8.exclude_fqns entry is whole dotted segments and matches a Linear: else one line naming it."""
    for e in exclude_fqns:
        if not e or e.startswith(".") or e.endswith(".") or ".." in e:
            raise ValueError(f"float8.exclude_fqns entry {e!r} must be whole dotted segments of a Linear's fqn "
                             f"(write {e.strip('.')!r}: an entry matches equal segments, never a substring)")
    unmatched = [e for e in exclude_fqns if not any(matches_exclusion(fqn, e) for fqn in linears)]
    if unmatched:
        raise ValueError(
            f"float8.exclude_fqns entry {unmatched[0]!r} matches no Linear layer "
            f"(Linear fqns look like {next(iter(linears), 'none')!r})"
        )


def matches_exclusion(fqn: str, entry: str) -> bool:
    """Whether a float8.exclude_fqns entry names this fqn (equal, or a run of its dotted components)."""
    return fqn == entry or f".{entry}." in f".{fqn}."


@dataclass
class Float8Linears(Float8Converter):
    """The Linears' converter of the torchao recipes (tensorwise, rowwise, rowwise_with_gw_hp): torchao's Float8Linear,
    or for tensorwise with delayed scaling or FP8 saved inputs our Float8TensorwiseLinear (tensorwise.py).

    Must run after EP and before activation checkpointing, torch.compile and FSDP2, which wrap whatever modules
    they find; never after TP (the config check refuses FP8 + TP). Logs the two confirmation lines. When the device
    has no FP8 matmul of the recipe it warns loudly and converts nothing (bf16 runs), or raises under
    float8.require."""

    role: ClassVar[str] = "linears"
    options: Float8Options
    converted: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    """fqn -> why it stays in high precision."""
    num_linear: int = 0

    def convert(self, model: nn.Module, *, device: torch.device) -> None:
        o = self.options
        tp = next((fqn for fqn, m in model.named_modules()
                   if isinstance(m, nn.Linear) and isinstance(m.weight, DTensor)), None)
        assert tp is None, f"{tp}.weight is a tensor-parallel DTensor: JobConfig refuses FP8 + tensor parallelism"
        # The config check refuses these: rowwise and blockwise cast everything to e4m3, and only tensorwise has
        # delayed scaling, fp8 saved inputs and (blockwise weights are all-gathered in bf16) an fp8 all-gather.
        assert o.format == "e4m3" or o.recipe == "tensorwise", (o.recipe, o.format)
        assert o.recipe == "tensorwise" or (o.delayed is None and not o.save_fp8_activations), o.recipe
        assert not (o.enable_fsdp_float8_all_gather and o.recipe == "blockwise"), "blockwise has no fp8 all-gather"
        # trainer.validate.float8_roles refuses these: a bf16 role runs its GEMMs from the bf16 weight and input.
        assert "bf16" not in (o.forward, o.backward) or not (
            o.enable_fsdp_float8_all_gather or o.delayed or o.save_fp8_activations), o
        converted, self.excluded, self.num_linear = select_float8_linears(
            model, exclude_fqns=list(o.exclude_fqns), recipe=o.recipe, bf16_blocks=dict(o.bf16_blocks))
        ok, what = fp8_supported(device, o.recipe)
        if not ok and not o.emulate:
            refuse_or_warn(what, require=o.require, setting="train.mixed_precision='fp8'",
                           headline=f"FP8 IS UNAVAILABLE ON THIS {'GPU' if device.type == 'cuda' else 'DEVICE'}",
                           instead="This run trains in BF16 instead.")
            return
        self._swap(model, set(converted), device=device)
        self.converted = converted
        self._log(model, what)

    def _swap(self, model: nn.Module, selected: set[str], *, device: torch.device) -> None:
        """torchao's Float8Linear for the selected Linears; format "e4m3" casts the tensorwise recipe's gradients to
        e4m3 too (torchao's default is e5m2). Then ours where tensorwise needs it (tensorwise.py)."""
        from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training  # torchao: fp8 runs only
        from torchao.float8.config import e4m3_dtype

        o = self.options
        if o.recipe == "tensorwise":
            grads = {"cast_config_grad_output": CastConfig(target_dtype=e4m3_dtype)} if o.format == "e4m3" else {}
            config = Float8LinearConfig(
                enable_fsdp_float8_all_gather=o.enable_fsdp_float8_all_gather, emulate=o.emulate, **grads
            )
        else:
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(o.recipe), emulate=o.emulate)
        config = with_roles(config, forward=o.forward, backward=o.backward)
        if device.type == "cpu" and not o.emulate and torch.backends.mkldnn.enabled:
            # oneDNN's fp8 GEMM on CPUs without AMX-FP8 is a reference loop, ~100x slower
            # than aten's own CPU _scaled_mm (same results; measured 0.9 s vs 0.01 s for
            # 1024x128x384). Disabling oneDNN routes torch._scaled_mm to aten's kernel.
            torch.backends.mkldnn.enabled = False
            logger.info("float8 on CPU: oneDNN disabled so torch._scaled_mm uses aten's CPU kernel")
        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in selected, config=config)
        both_fp8 = o.forward == o.backward == "fp8"  # our tensorwise linear runs FP8 both ways (float8_roles)
        assert both_fp8 or not OWN_TENSORWISE_LINEAR, "--own-fp8-linear times our linear, which has no bf16 role"
        if o.recipe == "tensorwise" and both_fp8 and (o.delayed is not None or o.save_fp8_activations
                                                      or o.weights_per_step or OWN_TENSORWISE_LINEAR):
            from trainer.parallel.float8.tensorwise import convert_to_tensorwise  # imports torchao

            convert_to_tensorwise(model, delayed=o.delayed is not None, save_fp8_input=o.save_fp8_activations)

    def _log(self, model: nn.Module, what: str) -> None:
        """The confirmation lines: what converted, what stayed bf16 and why, and what runs the matmuls."""
        for line in self.lines():
            logger.info(line)
        n = sum(1 for fqn, _ in model.named_parameters() if clean_fqn(fqn).endswith(".moe.experts.w1"))
        if n and self.options.moe_experts == "off":  # otherwise the experts' converter says what they run
            logger.info("MoE routed experts stay bf16: layers.*.moe.experts.{w1,w2,w3} x%d (grouped GEMM on 3-D "
                        "weights; float8.moe_experts='rowwise' runs them as FP8 grouped GEMMs)", n)
        logger.info("float8 matmuls: %s", self._emulated_line() if self.options.emulate else what)

    def _emulated_line(self) -> str:
        return "EMULATED in high precision (float8.emulate=true)"

    @classmethod
    def owns(cls, module: nn.Module) -> bool:
        from torchao.float8.float8_linear import Float8Linear  # torchao: fp8 runs only

        return isinstance(module, Float8Linear)

    def in_bf16(self, module: nn.Module) -> Callable[[], None]:
        """The module computes as nn.Linear (the same weight; F.linear) until the undo puts its class back."""
        cls = type(module)
        module.__class__ = nn.Linear
        return lambda: setattr(module, "__class__", cls)

    def lines(self) -> list[str]:
        """The startup's two lines: the recipe and its settings, then what converted and why the rest did not."""
        o = self.options
        by_reason: dict[str, list[str]] = {}
        for fqn, reason in self.excluded.items():
            by_reason.setdefault(reason, []).append(fqn)
        excluded = "; ".join(f"{', '.join(group_fqns(fqns))} ({reason})" for reason, fqns in by_reason.items())
        return [
            f"Applied Float8 training: recipe={o.recipe.upper()}, "
            f"fsdp_float8_all_gather={o.enable_fsdp_float8_all_gather}, format={describe_format(o.format)}"
            + describe_scaling(o.delayed, o.save_fp8_activations, all_gather=o.enable_fsdp_float8_all_gather)
            + ("" if o.forward == o.backward else f", {describe_roles(o.forward, o.backward)}")
            + (f", FP8 weights cast once per step ({o.weights_per_step} microbatch"
               f"{'es' if o.weights_per_step > 1 else ''} reuse them, backward and recompute too)"
               if o.weights_per_step else ""),
            f"converted {len(self.converted)}/{self.num_linear} Linear layers; excluded: {excluded or 'none'}",
        ]

    def fp8_layers_fields(self) -> dict:
        o = self.options
        return {"recipe": o.recipe, "format": o.format, **({"unavailable": o.unavailable} if o.unavailable else {}),
                **(o.delayed.as_json() if o.delayed else {}),
                **({"save_fp8_activations": True} if o.save_fp8_activations else {}),
                **({"forward": o.forward, "backward": o.backward} if o.forward != o.backward else {}),
                **({"bf16_blocks": {f"layers.{i}": why for i, why in o.bf16_blocks}} if o.bf16_blocks else {})}

    @classmethod
    def merged(cls, stages: list[Self]) -> Self:
        return dataclasses.replace(stages[0], converted=[fqn for s in stages for fqn in s.converted],
                                   excluded={fqn: why for s in stages for fqn, why in s.excluded.items()},
                                   num_linear=sum(s.num_linear for s in stages))

    def stages_lines(self, stages: list[Self]) -> list[str]:
        per_stage = ", ".join(f"{len(s.converted)}/{s.num_linear}" for s in stages)
        return [f"FP8 over all {len(stages)} pipeline stages ({per_stage} converted on stages 0..{len(stages) - 1}): "
                f"{self.lines()[1]}"]

    def step_hooks(self, model: nn.Module, *, amax_group: dist.ProcessGroup | None) -> list[StepHook]:
        """fp8 all-gather's weight-scale precompute, the weights' FP8 cast once per step (float8.weights_per_step),
        and delayed scaling (its amaxes reduced over `amax_group`: the data- and context-parallel ranks of this
        pipeline stage), where this run uses them."""
        o, hooks = self.options, []
        if not self.converted:
            return hooks
        if o.enable_fsdp_float8_all_gather:
            hooks.append(Float8ScalePrecompute(model))
        if o.weights_per_step:  # compute dtype of fp8 runs: bf16 (trainer.validate.resolve's _COMPUTE_DTYPE)
            from trainer.parallel.float8.weights_per_step import Fp8WeightsPerStep  # imports torchao

            hooks.append(Fp8WeightsPerStep(model, dtype=torch.bfloat16))
        if o.delayed is not None:
            from trainer.parallel.float8.delayed import DelayedScaling  # imports torchao

            d = o.delayed
            hooks.append(DelayedScaling(model, history_len=d.amax_history_len, algo=d.amax_compute_algo,
                                        margin=d.margin, group=amax_group))
        return hooks


@dataclass
class BlockwiseLinears(Float8Linears):
    """The Linears' converter of float8.recipe='blockwise': `BlockwiseFloat8Linear` for every selected Linear (both
    dims multiples of 128: `select_float8_linears`); the rest is the torchao recipes' converter."""

    def _swap(self, model: nn.Module, selected: set[str], *, device: torch.device) -> None:
        o = self.options
        convert_to_blockwise(model, selected, emulate=o.emulate, roles=(o.forward, o.backward))

    def _emulated_line(self) -> str:
        return ("EMULATED in plain torch (blockwise 1x128 / 128x128 e4m3 quantize-dequantize, fp32 matmuls; "
                "float8.emulate=true)")

    @classmethod
    def owns(cls, module: nn.Module) -> bool:
        return isinstance(module, BlockwiseFloat8Linear)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether a Linears' converter made this module (torchao's Float8Linear or a BlockwiseFloat8Linear)."""
    return Float8Linears.owns(module) or BlockwiseLinears.owns(module)


def with_roles(config, *, forward: str, backward: str):
    """torchao's Float8LinearConfig with the GEMMs of a bf16 role in high precision (float8.forward / backward).

    torchao casts each GEMM's operands by its own CastConfig: forward (input, weight), grad_input (grad_output,
    weight_for_grad_input), grad_weight (input_for_grad_weight, grad_output_for_grad_weight). A disabled cast
    multiplies the high-precision tensor itself, and backward re-casts from the bf16 input and weight that
    forward saved (torchao's matmul_with_hp_or_float8_args), so a bf16 backward never sees the forward's FP8
    casts. Each operand keeps its target dtype (torchao asserts both casts of an operand agree); a disabled
    cast is tensorwise (torchao allows rowwise with dynamic scaling only)."""
    from torchao.float8 import CastConfig, ScalingType  # torchao: fp8 runs only

    def off(cc):
        return CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=cc.target_dtype)

    c = config
    casts = dict(cast_config_input=c.cast_config_input, cast_config_weight=c.cast_config_weight,
                 cast_config_grad_output=c.cast_config_grad_output,
                 cast_config_input_for_grad_weight=c.cast_config_input_for_grad_weight,
                 cast_config_weight_for_grad_input=c.cast_config_weight_for_grad_input,
                 cast_config_grad_output_for_grad_weight=c.cast_config_grad_output_for_grad_weight)
    if forward == "bf16":
        casts |= {k: off(casts[k]) for k in ("cast_config_input", "cast_config_weight")}
    if backward == "bf16":
        casts |= {k: off(casts[k]) for k in ("cast_config_grad_output", "cast_config_input_for_grad_weight",
                                             "cast_config_weight_for_grad_input",
                                             "cast_config_grad_output_for_grad_weight")}
    return dataclasses.replace(c, **casts)


def describe_format(fp8_format: str) -> str:
    """float8.format in words: what is cast to which FP8 type."""
    return {"hybrid": "hybrid (e4m3 weights and activations, e5m2 gradients)", "e4m3": "e4m3 everywhere"}[fp8_format]


def describe_scaling(delayed: DelayedScalingSettings | None, save_fp8_activations: bool, *, all_gather: bool) -> str:
    """What the startup line adds for float8.scaling='delayed' and float8.save_fp8_activations ('' for neither)."""
    text = ""
    if delayed is not None:
        text += f", scaling={delayed.describe()}"
        if all_gather:  # the weight arrives cast by FSDP2 with the scale precomputed after the optimizer step
            text += " for inputs and gradients; weights cast with their current amax before the fp8 all-gather"
    if save_fp8_activations:
        text += ", fp8 inputs saved for backward"
    return text


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
        self.refresh()

    def refresh(self) -> None:
        """The scales of the weights as they are now (after a step, or an EMA swap: EMAWeights.after_swap)."""
        precompute_float8_scales(self.model)
