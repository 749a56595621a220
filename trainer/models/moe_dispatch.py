"""FP8 token dispatch (`moe.dispatch_dtype = "fp8"`): expert-sorted token rows cross the EP all-to-all as e4m3.

DeepSeek-V3's dispatch: each row is cut into blocks of `BLOCK` = 128 elements, each block gets one fp32 scale
(a power of two: E4M3_MAX / the block's amax, rounded down, as the FP8 experts' rowwise scales are), and the row
travels as D bytes of e4m3 plus D / 128 fp32 scales. Both go in one all-to-all of uint8 rows (gloo cannot move
float8, and one collective is one latency): [D e4m3 bytes | 4 * D / 128 scale bytes] per row, D + D / 32 bytes
instead of bf16's 2 * D (1.03 bytes per element instead of 2).

Rounding: a value v of a block with amax a is stored as q * 2^-s with 2^s <= E4M3_MAX / a, so |v| * 2^s <= 448;
e4m3 keeps 3 mantissa bits, so a normal value is off by at most 2^-4 of itself (half an ulp: 2^-(3+1)), and one
in e4m3's subnormal range (|v| * 2^s < 2^-6) by at most 2^-10 / 2^s (half its fixed step 2^-9) absolute. Since
2^s > 224 / a, that absolute bound is below a * 2^-10 / 224 < 2^-17 * a: every element is within
max(2^-4 |v|, 2^-17 a) of itself (tests/distributed/test_moe_dispatch_fp8.py holds the round trip to that).

Backward is straight-through (DeepSeek-V3): the quantization counts as the identity, and the gradient with
respect to the dispatched rows goes back through the reverse all-to-all in the compute dtype (bf16).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.models.moe_fp8 import E4M3, _dequantize, _quantize

BLOCK = 128
SCALE_BYTES = 4  # one fp32 per block


def fp8_bytes_per_token(dim: int) -> int:
    """Bytes one token row of `dim` elements moves with fp8 dispatch: dim e4m3 bytes + an fp32 scale per block."""
    assert dim % BLOCK == 0, dim  # trainer.validate checked it
    return dim + SCALE_BYTES * (dim // BLOCK)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] (D a multiple of 128) -> (e4m3 [N, D], fp32 dequantization scales [N, D / 128]): power-of-two
    scales, one per 1x128 block, x ~= data * scale repeated over each block."""
    n, d = x.shape
    data, scale = _quantize(x.view(n, d // BLOCK, BLOCK))  # the FP8 experts' rowwise quantization, a block a row
    return data.view(n, d), scale


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_blocks' inverse: data [N, D] e4m3, scale [N, D / 128] -> [N, D] in dtype (exact in bf16 and fp32:
    an e4m3 value times a power of two)."""
    n, d = data.shape
    return _dequantize(data.view(n, d // BLOCK, BLOCK), scale, dtype).view(n, d)


def pack_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 [N, D], fp32 [N, D / 128]) -> uint8 [N, D + 4 * D / 128]: what one all-to-all moves per row."""
    return torch.cat([data.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_rows' inverse for rows of `dim` elements."""
    return packed[:, :dim].contiguous().view(E4M3), packed[:, dim:].contiguous().view(torch.float32)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Fp8AllToAll(torch.autograd.Function):
    """Rows [N, D] -> the rows other ranks send here, moved as e4m3 + 1x128 scales and dequantized to x's dtype.

    Backward: the gradient goes back through the reverse all-to-all in its own dtype, the quantization taken
    as the identity (straight-through)."""

    @staticmethod
    def forward(ctx, x, recv_splits: list[int], send_splits: list[int], group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        data, scale = quantize_blocks(x)
        received = _all_to_all(pack_rows(data, scale), recv_splits, send_splits, group)
        return dequantize_blocks(*unpack_rows(received, x.shape[1]), x.dtype)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(grad, send_splits, recv_splits, ctx.group), None, None, None


@torch.compiler.disable  # a custom Function around c10d collectives with host-side split sizes: eager
def fp8_all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """`all_to_all_single_autograd(x, recv_splits, send_splits)` with the rows moved in FP8 (module docstring)."""
    return _Fp8AllToAll.apply(x, recv_splits, send_splits, group)
