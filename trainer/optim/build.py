"""Which AdamW a run builds, and the startup lines that say what it built."""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from trainer.distributed import plain_tensor
from trainer.optim.adamw import LowPrecisionAdamW
from trainer.optim.schedule import describe_schedule
from trainer.optim.states import StateDtypes
from trainer.optim.update import BF16AdamW

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
    (trainer/optim/kernel.py): torch's AdamW up to fp32 rounding order, faster than torch's fused kernel on FSDP2's
    shards (docs/benchmarks.md, the AdamW kernel) and compiled once for every shape. Checkpoints of either load
    into the other."""

    def _update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> None:
        import trainer.optim.kernel as adamw_kernel  # imported only where it runs: Triton is a GPU's

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
