"""distributed.reduce_dtype = "fp8": FSDP2's gradient reduce-scatter with the gradients exchanged in float8 (MS-AMP
O1's FP8 gradient communication), through FSDP2's own extension point, `FSDPModule.set_custom_reduce_scatter`.

FSDP2 hands its reduce-scatter one flat buffer per unit, every gradient of the unit laid out so that row r of the
buffer viewed as [world, n] is rank r's shard of each, in its reduce dtype (here the master dtype), and an output of n
elements in the same dtype. NCCL cannot sum float8, so instead of a reduce-scatter:

    amax = max |g| over the unit's whole buffer, all-reduced (MAX) over the shard group   one scalar per unit
    q    = float8(g * s), s = fp8_max / amax                                                the same s on every rank
    an all-to-all of q, as uint8 (gloo moves no float8): rank r receives row r of every rank's q
    out  = (sum over ranks of float32(q_j)) / (s * divide)                                  written in the reduce dtype

`divide` is the division FSDP2 asked for with its reduce op: AVG divides by the group's size, PREMUL_SUM by a
unit's gradient divide factor (trainer.parallel.fsdp's routed experts), SUM not at all (FSDP2 then divides itself).

Why e4m3 and not e5m2: the scale is this step's own amax over every rank, so nothing can overflow and e5m2's extra
range above the amax (what delayed scaling needs) buys nothing; below the amax e4m3 still resolves 2^17.8 (2^14.8
with normal numbers), and it halves e5m2's rounding (a relative error of at most 2^-4 per element, against 2^-3).
Every e4m3 value is a multiple of 2^-9 of magnitude at most 448, so the fp32 sum of up to 73 ranks' values is exact,
in any order: the quantization is the only rounding before the final division and the cast to the reduce dtype.

A non-finite gradient makes the unit's amax non-finite and every element of its output NaN, which the step's
gradient-norm check sees as it would have seen the original.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # the same interface in torch 2.11 and 2.13

# An amax below this (a unit whose gradients are all zero) would make fp8_max / amax infinite, and 0 * inf NaN.
_TINY_AMAX = 1e-30


def divisor_of(op: ReduceOp | ReduceOp.RedOpType, group_size: int) -> float:
    """What FSDP2's reduce op divides the sum by: AVG the group's size, PREMUL_SUM(f) 1/f, SUM nothing."""
    kind = getattr(op, "op", op)  # a PREMUL_SUM ReduceOp carries its factor; AVG and SUM come as bare RedOpTypes
    if kind == ReduceOp.SUM:
        return 1.0
    if kind == ReduceOp.AVG:
        return float(group_size)
    if kind == ReduceOp.PREMUL_SUM:
        return 1.0 / float(op.factor)
    raise AssertionError(f"FSDP2 asked its reduce-scatter for {op}, which the float8 reduce does not implement")


def quantize(grads: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """float8(grads * scale), the product in fp32 (scale is a 1-element fp32 tensor, so it promotes a bf16 buffer:
    one kernel, then the cast)."""
    return torch.mul(grads, scale).to(float8_dtype)


def shared_scale(grads: torch.Tensor, group: dist.ProcessGroup, float8_dtype: torch.dtype) -> torch.Tensor:
    """fp8_max / (the amax of `grads` over every rank of `group`): a 1-element fp32 tensor, the same on each."""
    # One reduction kernel, no |grads| temporary; the max of a bf16 buffer is one of its values, exact in fp32.
    amax = torch.linalg.vector_norm(grads, float("inf")).to(torch.float32).reshape(1)
    dist.all_reduce(amax, op=ReduceOp.MAX, group=group)
    return torch.finfo(float8_dtype).max / amax.clamp(min=_TINY_AMAX)


def sum_float8_rows(rows: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of the float8 rows [world, n] (torch promotes no float8, so each row is cast, then added)."""
    total = rows[0].to(torch.float32)
    for row in rows[1:]:  # one per rank, not per tensor
        total += row.to(torch.float32)
    return total


class Float8ReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of a unit's gradients, exchanged in float8 with one scale per unit (module docstring).

    FSDP2 calls it on its reduce-scatter stream, synchronously (torch 2.11 and 2.13); the collectives run on NCCL's
    stream behind that one, so nothing here waits on the host."""

    def __init__(self, float8_dtype: torch.dtype = torch.float8_e4m3fn):
        assert float8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2), float8_dtype
        self.float8_dtype = float8_dtype

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: ReduceOp | ReduceOp.RedOpType, async_op: bool = False) -> None:
        assert not async_op, "FSDP2 runs its reduce-scatter synchronously on its own stream"
        world = group.size()
        scale = shared_scale(input_tensor, group, self.float8_dtype)
        sent = quantize(input_tensor, scale, self.float8_dtype).view(torch.uint8)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)  # row r of every rank's buffer to rank r
        total = sum_float8_rows(received.view(self.float8_dtype).view(world, -1))
        # Divided in fp32 and cast to the output's dtype as it is stored: one kernel, one rounding to that dtype.
        torch.div(total, scale * divisor_of(op, world), out=output_tensor)
        return None
