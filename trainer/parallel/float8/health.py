"""FP8 health of weights, activations and gradients: what the casts into float8 lose.

Weights (every log step with the stats on): amax and the e4m3 scale it implies, per converted Linear
(`float8_weight_stats`) and per FP8 expert weight (`fp8_expert_weight_stats`).

At `metrics.fp8_stats_freq` steps, every converted Linear (torchao Float8Linear, or
BlockwiseFloat8Linear under the blockwise recipe) reports, per layer group (the same
projection across layers, e.g. `attention.q_proj`):

- the amax of its inputs (cast to e4m3) and of its output gradients (e5m2 under the
  tensorwise recipe, e4m3 under the rowwise and blockwise ones), and the scale that dynamic
  scaling gives them (format max / amax; per row for the rowwise recipes and per 1x128 tile
  for blockwise, the smallest such scale reported; blockwise's weight-gradient GEMM re-tiles
  the output gradient 128x1, which is not reported separately);
- the fraction of elements that underflow (non-zero, but below half the format's
  smallest subnormal after scaling: they become 0) and that saturate (beyond the
  format's max by more than rounding would absorb; dynamic scaling maps amax to max,
  so this stays 0 unless a scale is stale or wrong).

Both fractions are recomputed here from the bf16 tensors with torchao's scaling rule
(scale = max / clamp(amax, 1e-12)), not read from the kernels. One warning line names
the worst layer of a group whose underflow or saturation crosses the thresholds below.

At the same steps, the kurtosis of each transformer block's input across its channels (outliers.py: FOG's outlier
metric), with a warning above metrics.kurtosis_warn.

The hooks exist only during a stats step, which runs eagerly (compiled graphs cannot
host Python hooks). Measured on 8B shapes x 8 layers on one H200: a stats step costs
about 3.3 compiled steps and its peak memory is 102 GiB instead of 55, so the stats
are off by default and at fp8_stats_freq=100 cost ~2.3% of the time.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.hooks import StepHook
from trainer.log import EVERY_RANK
from trainer.models.llama import clean_fqn
from trainer.models.moe_fp8 import E4M3_MAX
from trainer.parallel.float8.blockwise import BLOCK
from trainer.parallel.float8.experts import fp8_experts_modules
from trainer.parallel.float8.linear import is_float8_linear
from trainer.parallel.float8.outliers import BlockInputKurtosis

logger = logging.getLogger(__name__)

# A warning when more than this fraction of a layer's elements underflow / saturate.
UNDERFLOW_WARN = 0.01
SATURATION_WARN = 1e-4

_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _format_limits(fmt: str) -> tuple[float, float, float]:
    """(max, the value above which rounding cannot reach max, smallest subnormal) of an fp8 format."""
    info = torch.finfo(_FORMATS[fmt])
    mantissa_bits = {"e4m3": 3, "e5m2": 2}[fmt]
    return (float(info.max), float(info.max) * (1 + 2.0 ** -(mantissa_bits + 1)),
            float(info.smallest_normal) * 2.0 ** -mantissa_bits)


def cast_health(x: torch.Tensor, fmt: str, *, rowwise: bool, tile: int = 0) -> dict[str, torch.Tensor]:
    """amax, scale, and the counts of elements that underflow / saturate when x is cast to fmt.

    One scale for all of x, per row (`rowwise`), or per 1 x `tile` group of the last dim (`tile`, blockwise).
    Device tensors (no host sync): {"amax", "scale", "underflow", "saturated", "numel"}.
    """
    fmax, saturates_above, tiny = _format_limits(fmt)
    x = x.detach().float().reshape(-1, tile or x.shape[-1])
    rowwise = rowwise or bool(tile)
    magnitude = x.abs()
    amax = magnitude.amax(dim=-1, keepdim=True) if rowwise else magnitude.amax()
    scale = fmax / amax.clamp(min=1e-12)
    scaled = magnitude * scale
    return {
        "amax": amax.max(),
        "scale": scale.min(),
        "underflow": ((scaled < tiny / 2) & (magnitude > 0)).sum(),
        # Above max by less than half its last step rounds to max anyway: only beyond that is clipping lossy.
        "saturated": (scaled > saturates_above).sum(),
        "numel": torch.tensor(x.numel(), device=x.device),
    }


def layer_group(fqn: str) -> str:
    """`layers.3.attention.q_proj` -> `attention.q_proj`; `output_head.proj` stays."""
    parts = fqn.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        return ".".join(parts[2:])
    return fqn


class Fp8HealthMonitor:
    """Collect cast health of every Float8Linear, and of the FP8 routed experts (float8.moe_experts), during the
    steps run inside `collect()`.

    An FP8 experts module's input is its tokens, cast rowwise to e4m3 before the w1/w3 grouped GEMM, and its
    output gradient the rows cast rowwise to e4m3 for w2's dgrad (group `moe.experts`).
    """

    def __init__(self, model: nn.Module, *, recipe: str):
        grad_format = "e5m2" if recipe == "tensorwise" else "e4m3"
        self.modules = {clean_fqn(fqn): m for fqn, m in model.named_modules() if is_float8_linear(m)}
        # fqn -> (rowwise, tile (blockwise: 128 values per scale; 0 = whole rows or tensor), output gradient's format)
        tile = BLOCK if recipe == "blockwise" else 0
        self.formats = {fqn: (recipe != "tensorwise", tile, grad_format) for fqn in self.modules}
        for fqn, module in fp8_experts_modules(model).items():
            self.modules[fqn] = module
            self.formats[fqn] = (True, 0, "e4m3")
        self._stats: dict[tuple[str, str], list[dict[str, torch.Tensor]]] = defaultdict(list)

    def grad_format(self, fqn: str) -> str:
        return self.formats[fqn][2]

    def _record(self, fqn: str, kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        rowwise, tile, grad_format = self.formats[fqn]
        fmt = "e4m3" if kind == "input" else grad_format
        self._stats[(fqn, kind)].append(cast_health(tensor, fmt, rowwise=rowwise, tile=tile))

    @contextlib.contextmanager
    def collect(self):
        """Run the enclosed forward/backward eagerly with hooks on every converted Linear."""
        def on_output(fqn: str, output: torch.Tensor) -> None:
            # A tensor hook, not a module backward hook: it composes with activation checkpointing
            # (the recomputed forward's outputs are not on the gradient path, so nothing counts twice).
            if output.requires_grad:
                output.register_hook(lambda grad: self._record(fqn, "grad", grad))

        handles = []
        for fqn, module in self.modules.items():
            handles.append(module.register_forward_pre_hook(
                lambda m, args, fqn=fqn: self._record(fqn, "input", args[0])))
            handles.append(module.register_forward_hook(lambda m, args, out, fqn=fqn: on_output(fqn, out)))
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def report(self) -> dict[str, float]:
        """Per group and kind: amax, scale, underflow and saturation fractions; warns once per bad group.

        One host sync. Clears what was collected.
        """
        per_layer: dict[tuple[str, str], dict[str, float]] = {}
        for key, records in self._stats.items():
            stacked = {k: torch.stack([r[k] for r in records]) for k in records[0]}
            numel = stacked["numel"].sum()
            summary = torch.stack([stacked["amax"].max(), stacked["scale"].min(),
                                   stacked["underflow"].sum() / numel, stacked["saturated"].sum() / numel])
            amax, scale, underflow, saturated = summary.tolist()
            per_layer[key] = {"amax": amax, "scale": scale, "underflow": underflow, "saturated": saturated,
                              "numel": float(numel.item())}
        self._stats.clear()
        groups: dict[tuple[str, str], list[tuple[str, dict[str, float]]]] = defaultdict(list)
        for (fqn, kind), s in per_layer.items():
            groups[(layer_group(fqn), kind)].append((fqn, s))
        out: dict[str, float] = {}
        for (group, kind), layers in sorted(groups.items()):
            numel = sum(s["numel"] for _, s in layers)
            prefix = f"fp8_health/{kind}/{group}"
            out[f"{prefix}/amax"] = max(s["amax"] for _, s in layers)
            out[f"{prefix}/scale"] = min(s["scale"] for _, s in layers)
            out[f"{prefix}/underflow"] = sum(s["underflow"] * s["numel"] for _, s in layers) / numel
            out[f"{prefix}/saturated"] = sum(s["saturated"] * s["numel"] for _, s in layers) / numel
            for what, limit in (("underflow", UNDERFLOW_WARN), ("saturated", SATURATION_WARN)):
                fqn, worst = max(layers, key=lambda item: item[1][what])
                if worst[what] > limit:
                    fmt = "e4m3" if kind == "input" else self.grad_format(fqn)
                    logger.warning(
                        "fp8 health: %.2f%% of %s's %s elements %s in %s (amax %.3g, scale %.3g; warning above "
                        "%.2g%%): a few outliers stretch the scale; consider float8.recipe='rowwise' or "
                        "excluding the layer (float8.exclude_fqns)", 100 * worst[what], fqn,
                        "input" if kind == "input" else "output-gradient",
                        "underflow to zero" if what == "underflow" else "saturate", fmt, worst["amax"],
                        worst["scale"], 100 * limit, extra=EVERY_RANK)  # this rank's tokens and layers
        return out


class Fp8HealthHook(StepHook):
    """The FP8 health step hook: every `every` steps, collect cast health and the blocks' input kurtosis
    (trainer/parallel/float8/outliers.py; a warning above `kurtosis_warn`, 0 = none) during the step (eagerly) and
    log them with the weights' amax and scale (`float8_weight_stats`, `fp8_expert_weight_stats`)."""

    def __init__(self, model: nn.Module, *, recipe: str, every: int, kurtosis_warn: float = 0.0):
        self.model, self.every = model, every
        self.monitor = Fp8HealthMonitor(model, recipe=recipe)
        self.outliers = BlockInputKurtosis(model, warn_above=kurtosis_warn)

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        if not self.log_due(step):
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.monitor.collect())  # first: the step runs eagerly, so every hook fires
        stack.enter_context(self.outliers.collect())
        return stack

    def log_due(self, step: int) -> bool:
        return step % self.every == 0

    def on_log(self, step: int) -> dict[str, float]:
        if not self.log_due(step):
            return {}
        return {**float8_weight_stats(self.model), **fp8_expert_weight_stats(self.model), **self.monitor.report(),
                **self.outliers.report()}


def float8_weight_stats(model: nn.Module) -> dict[str, float]:
    """Per converted layer: weight amax and the tensorwise e4m3 scale it implies.

    For a blockwise layer that scale is its smallest 128x128 block scale (the block holding the amax).
    A tiny amax (scale near its upper range) means small weights lose precision to
    underflow; a growing amax shows outliers building up. For TensorBoard.
    """
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    stats: dict[str, float] = {}
    for fqn, mod in model.named_modules():
        if is_float8_linear(mod):
            weight = mod.weight.full_tensor() if isinstance(mod.weight, DTensor) else mod.weight
            amax = weight.detach().abs().max().float().item()
            name = clean_fqn(fqn)
            stats[f"fp8/weight_amax/{name}"] = amax
            stats[f"fp8/weight_scale/{name}"] = fp8_max / max(amax, 1e-12)
    return stats


def fp8_expert_weight_stats(model: nn.Module) -> dict[str, float]:
    """Per FP8 expert weight: amax over the whole (global) tensor and E4M3_MAX / amax, the scale its largest row
    gets before rounding down to a power of two (the smallest of its rowwise scales). Host syncs: log steps."""
    stats: dict[str, float] = {}
    for fqn, module in fp8_experts_modules(model).items():
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
