"""Which AdamW a run builds (the implementation trainer.validate resolved), and the startup lines that say what it built.

    "triton", "eager", "fused"   our AdamW over the local shards (trainer/optim/adamw.py)
    "torch_fused", "foreach"     torch.optim.AdamW on the (DTensor) parameters: references of plain AdamW
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from trainer.models.layers import clean_fqn
from trainer.optim.adamw import AdamW, Rounding, is_rounded
from trainer.optim.schedule import describe_schedule
from trainer.optim.states import StateDtypes

Implementation = Literal["triton", "eager", "fused", "torch_fused", "foreach"]


def resolve_implementation(implementation: str, *, device_type: str, rounded: bool) -> Implementation:
    """optimizer.implementation='auto': our Triton kernel on a GPU (fp32 master weights: 0.90x the time of torch's
    fused kernel on plain tensors, where torch's kernel on FSDP2's shards takes 1.19x: docs/benchmarks.md, the AdamW
    kernel); on a CPU (no Triton there) torch's fused kernel over the local shards, or the eager update where the
    state is rounded (trainer.optim.adamw.is_rounded: torch's kernels cannot round it)."""
    if implementation != "auto":
        return implementation
    if device_type == "cuda":
        return "triton"
    return "eager" if rounded else "fused"


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: Implementation,
    dtypes: StateDtypes | None = None,
    rounding: Rounding = "nearest",
    seed: int = 0,
) -> torch.optim.Optimizer:
    """AdamW over `model`'s parameters: ours (trainer.optim.adamw.AdamW: "triton", "eager", "fused") with these
    state dtypes (None: the parameters') and rounding, its random bits keyed by `seed` and each parameter's clean
    fqn; or torch's ("torch_fused": torch.optim.AdamW(fused=True) on the DTensor parameters, "foreach"), which only
    runs plain AdamW (trainer.validate refuses the rest, naming both keys)."""
    named = list(model.named_parameters())
    if implementation in ("torch_fused", "foreach"):
        assert dtypes is None or not is_rounded(dtypes, rounding), (implementation, dtypes, rounding)
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 fused=implementation == "torch_fused", foreach=implementation == "foreach")
    return AdamW([p for _, p in named], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                 implementation=implementation, dtypes=dtypes, rounding=rounding, seed=seed,
                 names=[clean_fqn(n) for n, _ in named])


def describe_param_groups(optimizer: torch.optim.Optimizer, schedule: dict) -> str:
    """One line: each parameter group's tensor and element counts and its weight decay, then the lr schedule.

    The lr is the peak (LambdaLR's `initial_lr`, the configured optimizer.lr), not the group's current
    lr: at startup that is warmup's first step, which reads like a wrong setting.
    """
    parts = []
    for i, group in enumerate(optimizer.param_groups):
        params = group["params"]
        parts.append(f"{f'group {i}: ' if len(optimizer.param_groups) > 1 else ''}{len(params)} tensors, "
                     f"{sum(p.numel() for p in params):,} parameters, weight_decay={group['weight_decay']:g}")
    peaks = {group.get("initial_lr", group["lr"]) for group in optimizer.param_groups}
    assert len(peaks) == 1, f"build_optimizer gives every group one lr, not {sorted(peaks)}"
    name = type(optimizer).__name__ + (f" ({optimizer.describe()})" if isinstance(optimizer, AdamW) else "")
    return (f"{name}, {len(parts)} group{'s' if len(parts) > 1 else ''}: " + "; ".join(parts)
            + f"; {describe_schedule(peaks.pop(), **schedule)}")


_PATHS = {"triton": "the Triton kernel", "fused": "torch's fused kernel over the local shards",
          "eager": "eager torch per tensor"}


def _update_path(optimizer: torch.optim.Optimizer) -> str:
    """Which code runs the update, in words."""
    if isinstance(optimizer, AdamW):
        return _PATHS[optimizer.implementation]
    return "torch.optim.AdamW (" + ("fused" if optimizer.defaults.get("fused") else "foreach") + ")"


def describe_optimizer_state(optimizer: torch.optim.Optimizer) -> str:
    """One startup line: each state's dtype, the optimizer state's bytes per parameter (master weights included),
    and which update runs. Under exp_avg_dtype='fp8' it counts the tensors whose first moment stays bf16."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    numel = sum(p.numel() for p in params) or 1
    ours = isinstance(optimizer, AdamW)
    dtypes, kahan = (optimizer.dtypes, optimizer.kahan) if ours else (StateDtypes.of(params), False)
    sizes = dtypes.bytes_per_param(kahan=kahan)
    exp_avg = dtypes.exp_avg
    if dtypes.exp_avg == "fp8":
        fp8 = [p for p in params if optimizer.uses_fp8(p)]
        sizes["exp_avg"] = (sum(p.numel() for p in fp8) * sizes["exp_avg"]
                            + sum(p.numel() for p in params if not optimizer.uses_fp8(p)) * 2.0) / numel
        exp_avg = (f"fp8 e4m3 (1x128 blocks of the global tensor, power-of-two fp32 scales, stochastic rounding) "
                   f"in {len(fp8)}/{len(params)} tensors, bf16 in {len(params) - len(fp8)} (1-D, last dim not a "
                   f"multiple of 128, or a shard cutting a block)")
    stochastic = ours and optimizer.rounded  # plain AdamW rounds to nearest
    rounding = lambda d: ("" if d != "bf16" else " (stochastic rounding)" if stochastic  # noqa: E731
                          else " (round to nearest)")
    bytes_ = " + ".join(f"{k} {v:.3g}" for k, v in sizes.items()) + f" = {sum(sizes.values()):.3g} B/param"
    return (f"master {dtypes.master}{' (Kahan)' if kahan else ''}; exp_avg {exp_avg}{rounding(dtypes.exp_avg)}; "
            f"exp_avg_sq {dtypes.exp_avg_sq}{rounding(dtypes.exp_avg_sq)}; {bytes_}; update: {_update_path(optimizer)}")
