"""What the FP8 conversion did, dense Linears and routed experts: one report for logs, metrics and tests."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from trainer.parallel.float8.options import DelayedScalingSettings


@dataclass
class ExpertsConversion:
    """The routed experts run as FP8 grouped GEMMs (float8.moe_experts; trainer.parallel.float8.experts)."""

    mode: str
    num_layers: int
    per_step_weights: bool

    def line(self) -> str:
        weights = ("once per optimizer step and kept for its forwards" if self.per_step_weights
                   else "in each forward and backward, none kept")
        return (f"routed experts: FP8 {self.mode} grouped GEMM, layers.*.moe.experts.{{w1,w2,w3}} x{self.num_layers} "
                f"(forward and dgrad in e4m3, wgrad bf16; tokens quantized once before the expert gather, weights "
                f"quantized {weights})")


@dataclass
class Float8Report:
    """What apply_float8 (and, for MoE models, apply_fp8_experts) did, for logs, metrics and tests."""

    recipe: str
    fsdp_float8_all_gather: bool
    emulate: bool
    converted: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)  # fqn -> reason
    num_linear: int = 0
    experts: ExpertsConversion | None = None
    """Set where the routed experts run FP8 grouped GEMMs; None: they stay bf16 (or the model has none)."""
    format: str = "hybrid"
    """float8.format resolved: "hybrid" or "e4m3"."""
    delayed: DelayedScalingSettings | None = None
    """float8.scaling='delayed' and its settings; None: dynamic scales (each tensor's own amax)."""
    save_fp8_activations: bool = False
    """float8.save_fp8_activations: the Linears keep their float8 inputs for backward instead of the bf16 ones."""

    @property
    def enabled(self) -> bool:
        return bool(self.converted)

    @property
    def converted_fraction(self) -> float:
        return len(self.converted) / self.num_linear if self.num_linear else 0.0

    def lines(self) -> list[str]:
        """The Linears' two lines, then the routed experts' line where they run in FP8."""
        by_reason: dict[str, list[str]] = {}
        for fqn, reason in self.excluded.items():
            by_reason.setdefault(reason, []).append(fqn)
        excluded = "; ".join(f"{', '.join(group_fqns(fqns))} ({reason})" for reason, fqns in by_reason.items())
        lines = [
            f"Applied Float8 training: recipe={self.recipe.upper()}, "
            f"fsdp_float8_all_gather={self.fsdp_float8_all_gather}, format={describe_format(self.format)}"
            + describe_scaling(self.delayed, self.save_fp8_activations, all_gather=self.fsdp_float8_all_gather),
            f"converted {len(self.converted)}/{self.num_linear} Linear layers; excluded: {excluded or 'none'}",
        ]
        return lines + ([self.experts.line()] if self.experts else [])


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


def merge_reports(reports: list[Float8Report | None]) -> Float8Report | None:
    """The whole model's report from its pipeline stages' (in stage order); None when no stage has one."""
    reports = [r for r in reports if r is not None]
    if not reports:
        return None
    merged = dataclasses.replace(reports[0], converted=[], excluded={}, num_linear=0, experts=None)
    for r in reports:
        merged.converted += r.converted
        merged.excluded.update(r.excluded)
        merged.num_linear += r.num_linear
        if r.experts is not None:  # a stage without MoE layers has none
            n = r.experts.num_layers + (merged.experts.num_layers if merged.experts else 0)
            merged.experts = dataclasses.replace(r.experts, num_layers=n)
    return merged


_FIRST_INDEX = re.compile(r"^(.*?)\.(\d+)(?:\.(.*))?$")


def group_fqns(fqns: list[str]) -> list[str]:
    """Every fqn of `fqns`, written compactly and exactly, in model order.

    Fqns are split at their first numeric part (the layer index); the names under one index
    are braced, and indices holding the same names share one entry:
    ["layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj"]
    -> ["layers.{0,1}.{mlp.up_proj,mlp.down_proj}"]; "layers.{0..31}.moe.router" is 32 layers.
    """
    # (head, suffixes under one index) -> indices, in order of first appearance.
    under: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int] | str] = []
    for fqn in fqns:
        m = _FIRST_INDEX.match(fqn)
        if m is None:
            order.append(fqn)
            continue
        key = (m.group(1), int(m.group(2)))
        if key not in under:
            under[key] = []
            order.append(key)
        under[key].append(m.group(3) or "")
    shared: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for (head, index), suffixes in under.items():
        shared.setdefault((head, tuple(suffixes)), []).append(index)
    out: list[str] = []
    done: set[tuple[str, tuple[str, ...]]] = set()
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        key = (item[0], tuple(under[item]))
        if key in done:
            continue
        done.add(key)
        head, suffixes = key
        names = suffixes[0] if len(suffixes) == 1 else "{" + ",".join(suffixes) + "}"
        out.append(f"{head}.{_braced_indices(shared[key])}" + (f".{names}" if names else ""))
    return out


def _braced_indices(indices: list[int]) -> str:
    """[3] -> "3", [0, 2] -> "{0,2}", [0, 1, 2, 3, 7] -> "{0..3,7}"."""
    indices = sorted(indices)
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}..{r[-1]}" if len(r) >= 3 else ",".join(map(str, r)) for r in runs]
    text = ",".join(parts)
    return text if len(indices) == 1 else "{" + text + "}"
