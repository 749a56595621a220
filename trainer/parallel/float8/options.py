"""What an fp8 run converts and how: `Float8Options`, made once by the validation pass (trainer.validate.resolve's
`resolve_float8`) and handed to `apply_float8` (trainer.parallel.float8.apply), which reads nothing else.

A leaf: it imports nothing of the trainer, so the validation pass and the converters both stand on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"]


@dataclass(frozen=True)
class DelayedScalingSettings:
    """float8.scaling='delayed' (tensorwise): Transformer Engine's DelayedScaling knobs."""

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0

    def describe(self) -> str:
        return (f"delayed (amax_history_len={self.amax_history_len}, amax_compute_algo={self.amax_compute_algo}, "
                f"margin={self.margin})")

    def as_json(self) -> dict:
        return {"scaling": "delayed", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Float8Options:
    """The [float8] section resolved: everything the FP8 converters need (trainer.parallel.float8.apply)."""

    recipe: Recipe
    enable_fsdp_float8_all_gather: bool = False
    exclude_fqns: tuple[str, ...] = ()
    """float8.exclude_fqns: each names a Linear (equal, or a run of its dotted components); stage builds keep the
    entries that match a Linear of their stage (trainer.parallel.build)."""
    emulate: bool = False
    require: bool = False
    """float8.require: stop where FP8 kernels cannot run here, instead of training those matmuls in bf16."""
    moe_experts: str = "off"
    """float8.moe_experts: "off" or "rowwise" (trainer.parallel.float8.experts)."""
    expert_weights_per_step: bool = False
    """Keep the FP8 expert weights through the optimizer step (trainer.models.moe_fp8.Fp8ExpertWeights)."""
    weights_per_step: int = 0
    """float8.weights_per_step resolved: the forwards per optimizer step (accumulation x pipeline microbatches) that
    share each Linear's FP8 weight, cast once when the step starts (trainer.parallel.float8.weights_per_step); 0:
    each use casts the weight."""
    kept_weight_numel: int = 0
    """With weights_per_step: the converted Linears' weight elements of the whole model (the memory plan's row)."""
    format: str = ""
    """float8.format resolved: "hybrid" (e4m3 forward, e5m2 gradients; tensorwise only) or "e4m3" (everywhere);
    "" (a test's options) is the recipe's own (`resolve_format`)."""
    delayed: DelayedScalingSettings | None = None
    """float8.scaling='delayed' with its settings (tensorwise only); None: dynamic scaling."""
    save_fp8_activations: bool = False
    """float8.save_fp8_activations (tensorwise only)."""
    unavailable: str = ""
    """Why this device runs no FP8 matmuls of the recipe (the Linears train in bf16; apply_float8 says so loudly), as
    the validation pass's probe found it; "" where they run (or are emulated, or a dry run plans FP8 GPUs)."""
    experts_unavailable: str = ""
    """Why this device runs no FP8 grouped GEMM for float8.moe_experts (the experts train in bf16); "" where it runs."""
    bf16_blocks: tuple[tuple[int, str], ...] = ()
    """(global block index, why) of every transformer block kept bf16 (float8.bf16_first_blocks / bf16_last_blocks,
    resolved by trainer.validate.float8_roles); a pipeline stage keeps those it holds, by the same global index."""
    forward: str = "fp8"
    """float8.forward: "fp8" or "bf16", the forward GEMM of a converted Linear and the FP8 experts' forward GEMMs."""
    backward: str = "fp8"
    """float8.backward: "fp8" or "bf16", the two backward GEMMs (from the bf16 input and weight when "bf16")."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude_fqns", tuple(self.exclude_fqns))
        object.__setattr__(self, "bf16_blocks", tuple((int(i), why) for i, why in dict(self.bf16_blocks).items()))
        assert {self.forward, self.backward} <= {"fp8", "bf16"} and "fp8" in (self.forward, self.backward), self
        if not self.format:
            object.__setattr__(self, "format", resolve_format(self.recipe))


def describe_roles(forward: str, backward: str) -> str:
    """float8.forward / float8.backward in the words of the startup line."""
    return f"forward={forward.upper()}, backward={backward.upper()} (dgrad and wgrad)"


def resolve_format(recipe: str, requested: str = "auto") -> str:
    """float8.format resolved for `recipe`: "hybrid" (e5m2 gradients) where tensorwise keeps its default or asks
    for it, else "e4m3" (rowwise and blockwise cast every operand to e4m3; the config check refuses "hybrid")."""
    return "hybrid" if recipe == "tensorwise" and requested in ("auto", "hybrid") else "e4m3"


def kept_weight_bytes(numel: int, *, recipe: str) -> int:
    """float8.weights_per_step: what a kept cast of `numel` weight elements holds, 1 byte each, and under blockwise
    one fp32 scale per 128x128 block (a converted blockwise weight is whole blocks); tensorwise's one scalar scale
    per weight is not counted."""
    return numel + (4 * numel // (128 * 128) if recipe == "blockwise" else 0)
