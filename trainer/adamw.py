"""The AdamW arithmetic, written once for every optimizer of the trainer, and the plain tensor it updates.

`adamw_update` is one step of AdamW (decoupled weight decay, bias correction) in the caller's precision; the fp32
optimizer adds the returned delta to its weights, BF16AdamW rounds weights and moments to bf16 (trainer/bf16_adamw.py).
`plain_tensor` is the one rule for reaching the tensor under torchao's fp8 all-gather wrapper and a DTensor;
`Layout` where a local tensor sits in its global one (BF16AdamW's random bits are keyed by the global index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


def adamw_update(
    p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: torch.Tensor,
    bias_correction1: torch.Tensor, bias_correction2_sqrt: torch.Tensor, beta1: float, beta2: float, eps: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new exp_avg, new exp_avg_sq, delta) of one AdamW step: the weights become p + delta. Nothing in place."""
    m = exp_avg.lerp(g, 1 - beta1)
    v = exp_avg_sq.lerp(g * g, 1 - beta2)
    delta = -lr * (weight_decay * p + (m / bias_correction1) / (v.sqrt() / bias_correction2_sqrt + eps))
    return m, v, delta


def _unwrap_float8(t: torch.Tensor) -> torch.Tensor:
    """`t` without torchao's float8 all-gather wrapper (`WeightWithDynamicFloat8CastTensor`), same storage.

    Checked by duck type (a tensor subclass holding `_tensor`), so nothing here imports torchao."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and isinstance(getattr(t, "_tensor", None), torch.Tensor):
        return t._tensor
    return t


def plain_tensor(t: torch.Tensor, *, local: bool = False) -> torch.Tensor:
    """`t` unwrapped from torchao's fp8 all-gather wrapper; with local=True also a DTensor's local shard.

    local=True is what an optimizer updates in place. Not DTensor.to_local(): that is an autograd function call,
    which per tensor and per step was most of the optimizer's host time (the GPU waited on it). Not the wrapper:
    once FP8 scales are precomputed it holds a scale tensor that torchao's __tensor_flatten__ tests for truth,
    which compiled code cannot do (the compiled update failed from step 2 under fp8 + FSDP2 + bf16 master weights).
    local=False keeps a DTensor a DTensor (checkpoints save global tensors), with its local tensor unwrapped.
    """
    if not isinstance(t, DTensor):
        return _unwrap_float8(t)
    inner = _unwrap_float8(t._local_tensor)
    if local:
        return inner
    if inner is t._local_tensor:
        return t
    return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


@dataclass(frozen=True)
class Layout:
    """Where a local tensor's elements sit in its global tensor: what the rounding's random bits are keyed by."""

    offsets: tuple[int, ...]
    """The local block's offset in the global tensor, per dim."""
    global_shape: tuple[int, ...]

    @property
    def strides(self) -> tuple[int, ...]:
        """The global tensor's contiguous strides."""
        strides = [1] * len(self.global_shape)
        for d in range(len(strides) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.global_shape[d + 1]
        return tuple(strides)

    @classmethod
    def of(cls, p: torch.Tensor) -> Layout:
        """p's layout: a DTensor's local block, or all of a plain tensor."""
        shape = tuple(p.shape)
        if not isinstance(p, DTensor):
            return cls((0,) * len(shape), shape)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
        return cls(tuple(offsets), shape)
