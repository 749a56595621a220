"""AdamW and the learning-rate schedule."""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
from torch import nn

from trainer.adamw import plain_tensor
from trainer.bf16_adamw import BF16AdamW
from trainer.lowp_adamw import LowPrecisionAdamW
from trainer.optim_states import StateDtypes

_local = functools.partial(plain_tensor, local=True)  # the plain tensor an optimizer updates in place


class LocalFusedAdamW(torch.optim.AdamW):
    """torch's fused AdamW kernel run once per device and dtype over the LOCAL tensors of the parameters.

    The same state as `torch.optim.AdamW(fused=True)` ("step", "exp_avg", "exp_avg_sq"; the moments
    DTensors like their parameters, so checkpoints reshard as before) and the same protocol: set
    `grad_scale` (gradients are divided by it) and `found_inf` (a nonzero value skips the step on the
    device, the step counter included) before `step()`. torch's own step dispatches the fused kernel
    through DTensor, which splits it into many launches over sharded parameters; here
    `torch._fused_adamw_` gets every local shard of a device and dtype in one list.
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None

    def _init_state(self, p: torch.Tensor) -> dict:
        """p's state, created at its first step as torch's fused AdamW creates it (the step a 0-dim device tensor)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, f"{type(self).__name__} takes no closure"
        for group in self.param_groups:
            lists: dict[tuple, tuple[list, list, list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                local, grad = _local(p), _local(p.grad)
                entry = lists.setdefault((local.device, local.dtype, grad.dtype), ([], [], [], [], []))
                for out, t in zip(entry, (local, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                                          state["step"])):
                    out.append(t)
            for (device, _, _), tensors in lists.items():
                scale = None if self.grad_scale is None else self.grad_scale.to(device)
                inf = None if self.found_inf is None else self.found_inf.to(device)
                steps = tensors[-1]
                torch._foreach_add_(steps, 1)
                self._update(group, *tensors, grad_scale=scale, found_inf=inf)
                if inf is not None:  # a skipped step does not count (as in torch's fused AdamW)
                    torch._foreach_sub_(steps, [inf] * len(steps))
        return None

    def _update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> None:
        """One device's tensors of one dtype, their steps already counting this one."""
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
            beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            grad_scale=grad_scale, found_inf=found_inf,
        )


class TritonAdamW(LocalFusedAdamW):
    """LocalFusedAdamW's update, state and protocol as one launch of our Triton kernel per device and dtype
    (trainer/adamw_kernel.py): torch's AdamW up to fp32 rounding order, faster than torch's fused kernel on FSDP2's
    shards (docs/benchmarks.md, the AdamW kernel) and compiled once for every shape. Checkpoints of either load
    into the other."""

    def _update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> None:
        from trainer import adamw_kernel

        beta1, beta2 = group["betas"]
        adamw_kernel.adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr=group["lr"], beta1=beta1, beta2=beta2,
                                eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=grad_scale,
                                found_inf=found_inf, steps=steps)


def resolve_implementation(implementation: str, *, device_type: str) -> str:
    """optimizer.implementation='auto': our Triton kernel on a GPU (fp32 master weights: 0.90x the time of torch's
    fused kernel on plain tensors, where torch's kernel on FSDP2's shards takes 1.19x: docs/benchmarks.md, the AdamW
    kernel), torch's fused kernel over the local shards on a CPU (no Triton there)."""
    if implementation != "auto":
        return implementation
    return "triton" if device_type == "cuda" else "fused"


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: Literal["fused", "triton", "torch_fused", "foreach"],
    bf16_update: Literal["stochastic", "kahan", "nearest"] | None = None,
    seed: int = 0,
    triton: bool = False,
    dtypes: StateDtypes | None = None,
) -> torch.optim.Optimizer:
    """AdamW: "fused" runs torch's fused kernel over the local shards (LocalFusedAdamW), "triton" the same
    update as our Triton kernel (TritonAdamW), "torch_fused" is
    torch.optim.AdamW(fused=True) on the (DTensor) parameters, "foreach" torch's foreach AdamW; with bf16
    master weights (`bf16_update` not None) and a safe rounding, BF16AdamW.

    bf16_update='nearest' is torch AdamW on the bf16 weights (updates below half an ulp
    are lost). `seed` and `triton` apply to BF16AdamW only (its rounding's random bits;
    its update as the Triton kernel, not eagerly). `dtypes` with a moment outside the master
    dtype (optimizer.exp_avg_dtype / exp_avg_sq_dtype): LowPrecisionAdamW, whatever the implementation.
    """
    from trainer.models.layers import clean_fqn

    if dtypes is not None and not dtypes.in_master_dtype:
        named = list(model.named_parameters())
        return LowPrecisionAdamW([p for _, p in named], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 dtypes=dtypes, update=bf16_update or "stochastic", seed=seed, triton=triton,
                                 names=[clean_fqn(n) for n, _ in named])
    if bf16_update in ("stochastic", "kahan"):
        named = list(model.named_parameters())
        return BF16AdamW([p for _, p in named], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         update=bf16_update, seed=seed, triton=triton, names=[clean_fqn(n) for n, _ in named])
    if implementation == "triton":
        return TritonAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if implementation == "fused":
        return LocalFusedAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=implementation == "torch_fused",
        foreach=implementation == "foreach",
    )


def lr_lambda(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_type: Literal["cosine", "linear", "wsd", "constant"],
    min_lr_ratio: float,
    wsd_decay_ratio: float,
) -> float:
    """LR multiplier for optimizer step `step` (0-based: the first step uses step=0).

    Warmup reaches the peak at step warmup_steps - 1, so step 0 already trains
    (lr = peak / warmup_steps) instead of wasting a step at lr 0.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_type == "constant":
        return 1.0
    if decay_type == "wsd":
        decay_steps = max(1, int(total_steps * wsd_decay_ratio))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - min_lr_ratio) * min(progress, 1.0)
    progress = min((step - warmup_steps) / max(1, total_steps - warmup_steps), 1.0)
    if decay_type == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# The config key of each argument of lr_lambda, for a resume that says what changed.
SCHEDULE_KEYS = {"warmup_steps": "scheduler.warmup_steps", "total_steps": "train.steps",
                 "decay_type": "scheduler.decay_type", "min_lr_ratio": "scheduler.min_lr_ratio",
                 "wsd_decay_ratio": "scheduler.wsd_decay_ratio"}


def build_lr_scheduler(optimizer: torch.optim.Optimizer, **schedule) -> torch.optim.lr_scheduler.LambdaLR:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_lambda(step, **schedule))
    scheduler.schedule = dict(schedule)  # saved with the scheduler's state (LambdaLR saves its attributes)
    return scheduler


def describe_schedule(peak_lr: float, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_ratio: float,
                      wsd_decay_ratio: float) -> str:
    """The learning rate as lr_lambda shapes it, in words: the peak (the configured optimizer.lr), then the phases.

    Step numbers are the log's (1-based): step k runs lr_lambda(k - 1).
    """
    parts = [f"lr {peak_lr:g} peak"]
    if warmup_steps > 0:
        short = f" (train.steps={total_steps} ends inside it)" if warmup_steps > total_steps else ""
        parts.append(f"warmup {warmup_steps} steps linear{short}")
    if warmup_steps >= total_steps:
        return ", ".join(parts)  # the run ends inside the warmup: the decay never starts
    low = f"{peak_lr * min_lr_ratio:g}"
    if decay_type == "constant":
        parts.append("then constant" if warmup_steps else "constant")
    elif decay_type == "wsd":
        decay_start = max(warmup_steps, total_steps - max(1, int(total_steps * wsd_decay_ratio)))
        parts.append(f"constant to step {decay_start}, then linear decay to {low} over steps "
                     f"{decay_start + 1}-{total_steps}")
    else:
        parts.append(f"{decay_type} decay to {low} over steps {warmup_steps + 1}-{total_steps}")
    return ", ".join(parts)


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
    name = type(optimizer).__name__
    if isinstance(optimizer, LowPrecisionAdamW):
        name += f" ({optimizer.dtypes.master} master weights, moments in dtypes of their own)"
    elif isinstance(optimizer, BF16AdamW):
        name += f" (bf16 master weights, {optimizer.update} rounding)"
    return (f"{name}, {len(parts)} group{'s' if len(parts) > 1 else ''}: " + "; ".join(parts)
            + f"; {describe_schedule(peaks.pop(), **schedule)}")


def _update_path(optimizer: torch.optim.Optimizer) -> str:
    """Which code runs the update, in words."""
    if isinstance(optimizer, (TritonAdamW, BF16AdamW)) and getattr(optimizer, "triton", True):
        return "the Triton kernel"
    if isinstance(optimizer, LocalFusedAdamW):
        return "torch's fused kernel over the local shards"
    if isinstance(optimizer, BF16AdamW):
        return "eager torch per tensor"
    return "torch.optim.AdamW (" + ("fused" if optimizer.defaults.get("fused") else "foreach") + ")"


def describe_optimizer_state(optimizer: torch.optim.Optimizer) -> str:
    """One startup line: each state's dtype, the optimizer state's bytes per parameter (master weights included),
    and which update runs. Under exp_avg_dtype='fp8' it counts the tensors whose first moment stays bf16."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    numel = sum(p.numel() for p in params) or 1
    if isinstance(optimizer, LowPrecisionAdamW):
        dtypes = optimizer.dtypes
        kahan = dtypes.master == "bf16" and optimizer.update == "kahan"
    else:
        master = "bf16" if params and params[0].dtype == torch.bfloat16 else "fp32"
        dtypes, kahan = StateDtypes(master, master, master), getattr(optimizer, "update", None) == "kahan"
    sizes = dtypes.bytes_per_param(kahan=kahan)
    exp_avg = dtypes.exp_avg
    if dtypes.exp_avg == "fp8":
        fp8 = [p for p in params if optimizer.uses_fp8(p)]
        sizes["exp_avg"] = (sum(p.numel() for p in fp8) * sizes["exp_avg"]
                            + sum(p.numel() for p in params if not optimizer.uses_fp8(p)) * 2.0) / numel
        exp_avg = (f"fp8 e4m3 (1x128 blocks of the global tensor, power-of-two fp32 scales, stochastic rounding) "
                   f"in {len(fp8)}/{len(params)} tensors, bf16 in {len(params) - len(fp8)} (1-D, last dim not a "
                   f"multiple of 128, or a shard cutting a block)")
    stochastic = isinstance(optimizer, BF16AdamW)  # LowPrecisionAdamW too; torch's AdamW rounds to nearest
    rounding = lambda d: ("" if d != "bf16" else " (stochastic rounding)" if stochastic  # noqa: E731
                          else " (round to nearest)")
    bytes_ = " + ".join(f"{k} {v:.3g}" for k, v in sizes.items()) + f" = {sum(sizes.values()):.3g} B/param"
    return (f"master {dtypes.master}{' (Kahan)' if kahan else ''}; exp_avg {exp_avg}{rounding(dtypes.exp_avg)}; "
            f"exp_avg_sq {dtypes.exp_avg_sq}{rounding(dtypes.exp_avg_sq)}; {bytes_}; update: {_update_path(optimizer)}")
