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

The receiver keeps the rows in FP8 (`fp8_all_to_all_blocks`): the all-to-all's uint8 buffer, viewed as e4m3 data
and block scales (`Fp8Blocks`), and a gradient handle, a [N, D] tensor of the compute dtype with no memory behind it
(zero strides) that carries the rows' autograd edge. What the experts' kernel does with them:

- FP8 rowwise experts (`float8.moe_experts = "rowwise"`, `trainer.models.moe_fp8.Fp8GroupedSwiGLU`) requantize
  them rowwise in the 1-byte domain (`requantize_rowwise`: e4m3 in, e4m3 out, one compiled kernel on CUDA), then
  gather the byte rows and row scales into the padded expert order (`perm`, the received rows sorted by local
  expert, applies there) as they gathered the rows they quantized before: no [N, D] bf16 copy of the received
  rows is written or read, 2 * N * D bytes written (and read again) less per MoE layer and microbatch.
- Every other kernel (bf16 experts, `float8.forward`/`backward` roles) dequantizes them to the compute dtype
  (`Fp8Blocks.dequantize`, exact), as every kernel did before.

Why the requantization is bit for bit the old dequantize-then-quantize (`quantize_rows(dequantize_blocks(...))`)
for rows of finite values below 2^126: a block b holds e4m3 values q (|q| <= 448 < 2^9, at most 4 significant
bits) and its dequantization scale 2^-s_b, a power of two (quantize_blocks: 2^s_b <= 448 / max(amax, 1e-12) <
2^49, so 2^-s_b >= 2^-48; 2^s_b > 224 / amax, so 448 * 2^-s_b < 2 * amax).
1. Dequantized, v = q * 2^-s_b exactly: at most 4 significant bits, 2^-57 <= |v| < 2^127 for q != 0, in bf16's
   (fp32's) normal range. The bf16 copy held exactly these reals.
2. The row's amax: old max |v| over the row; new max over blocks of (max |q|) * 2^-s_b, each product exact in fp32
   by 1.: the same fp32 number, hence (`_pow2_scale`) the same row scale 2^s_row and dequantization scale
   1 / 2^s_row. (s_row may exceed s_b by one: a block whose largest value rounded down to 224 * 2^-s_b.)
3. Each element, r = q * 2^(s_row - s_b) = v * 2^s_row (a real): old fl(v * 2^s_row), new fl(q * fl(2^(s_row -
   s_b))), then the same clamp to +-448 and the same cast to e4m3, the one rounding.
   - |r| > 2^-11: 2^-20 < 2^(s_row - s_b) = |r / q| < 2^18 (|r| <= amax * 2^s_row, about 448; |q| >= 2^-9) is an
     fp32 number (a power of two), and so is r (at most 4 significant bits, exponent > -12): both paths hold the
     fp32 value r exactly, and the same clamp and cast round it the same way, e4m3's subnormals included (below
     2^-6 it rounds to a multiple of 2^-9: the same real, the same rounding).
   - |r| <= 2^-11: fl(2^(s_row - s_b)) <= 2^(s_row - s_b) (a power of two, exact or flushed to 0), so both fp32
     values are at most 2^-11 in magnitude, with q's sign (or a zero of q's sign); the cast rounds anything below
     2^-10 (half e4m3's smallest subnormal 2^-9) to the zero of that sign, in both.
tests/unit/test_moe_dispatch.py holds the bytes equal on crafted rows (blocks 12 decades apart, subnormals after
rescaling, zeros, -0, all-zero blocks) and random ones.

Backward is straight-through (DeepSeek-V3): the quantization counts as the identity, and the gradient with
respect to the dispatched rows (the handle's) goes back through the reverse all-to-all in the compute dtype
(bf16). The FP8 kernel's backward is unchanged: it saved the gathered FP8 rows before and still does (its weight
gradient dequantizes them), so no bf16 copy of the received rows is needed in backward either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

from trainer.models.moe_fp8 import E4M3, E4M3_MAX, _dequantize, _fused_on_cuda, _pow2_scale, _quantize

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
    """pack_rows' inverse for rows of `dim` elements: views of `packed`, no copy (rows are dim + dim / 32 bytes
    apart and their scales start dim bytes in, both multiples of 4 for dim a multiple of 128: the float32 view is
    aligned)."""
    return packed[:, :dim].view(E4M3), packed[:, dim:].view(torch.float32)


def _requantize_rowwise(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 rows (data [N, D], fp32 scales [N, D / 128]) -> the rows quantized rowwise (e4m3 [N, D], fp32
    scales [N]) without a bf16 copy: bit for bit `quantize_rows(dequantize_blocks(data, scale, bf16))` (module
    docstring: the proof). On CUDA one compiled kernel that reads 1 byte and writes 1 byte an element."""
    n, d = data.shape
    q = data.view(n, scale.shape[1], d // scale.shape[1]).float()  # [N, D / 128, 128]: e4m3 values, exact
    amax = (q.abs().amax(-1) * scale).amax(-1, keepdim=True)  # the dequantized row's amax, exact (docstring)
    row = _pow2_scale(amax)  # 2^s_row, what quantize_rows computes from that amax
    ratio = (scale * row).unsqueeze(-1)  # 2^(s_row - s_b) per block, a power of two
    return (q * ratio).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(n, d), row.reciprocal().squeeze(-1)


requantize_rowwise = _fused_on_cuda(_requantize_rowwise)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    # The functional collective: torch.compile traces it (split sizes as symbols), so the MoE layer stays one graph.
    return wait_tensor(all_to_all_single(x.contiguous(), out_splits, in_splits, group=group))


class _Fp8AllToAll(torch.autograd.Function):
    """Rows [N, D] -> (a gradient handle, e4m3 data, fp32 1x128 scales) of the rows other ranks send here.

    The handle is a [N_recv, D] tensor of x's dtype that holds no memory (one NaN, zero strides: whatever reads
    its values by mistake gets NaN, not plausible numbers): the received rows' autograd edge. Backward: the
    gradient w.r.t. the handle goes back through the reverse all-to-all in its own dtype, the quantization taken
    as the identity (straight-through)."""

    @staticmethod
    def forward(ctx, x, recv_splits: list[int], send_splits: list[int], group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        ctx.set_materialize_grads(False)  # no zero gradients allocated for the byte outputs
        data, scale = quantize_blocks(x)
        received = _all_to_all(pack_rows(data, scale), recv_splits, send_splits, group)
        data, scale = unpack_rows(received, x.shape[1])
        ctx.mark_non_differentiable(data, scale)
        handle = x.new_full((), float("nan")).expand(received.shape[0], x.shape[1])
        ctx.handle_meta = dict(size=handle.shape, dtype=handle.dtype, device=handle.device)
        return handle, data, scale

    @staticmethod
    def backward(ctx, grad, _data, _scale):
        recv_splits, send_splits = ctx.splits
        if grad is None:  # the handle got no gradient: zeros still cross, every rank runs the same collectives
            grad = torch.zeros(**ctx.handle_meta)
        return _all_to_all(grad, send_splits, recv_splits, ctx.group), None, None, None


class _DequantizeBlocks(torch.autograd.Function):
    """(handle, data, scale) -> the rows in the handle's dtype; the gradient passes to the handle unchanged."""

    @staticmethod
    def forward(ctx, handle, data, scale):
        return dequantize_blocks(data, scale, handle.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


@dataclass(frozen=True)
class Fp8Blocks:
    """Received rows as e4m3 data [N, D] and fp32 dequantization scales [N, D / 128], one per 1x128 block (views
    of the all-to-all's uint8 buffer); `trainer.models.moe_experts.ExpertRows.blocks`."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, handle: torch.Tensor) -> torch.Tensor:
        """The rows in handle's dtype (exact), differentiable through `handle` (`fp8_all_to_all_blocks`'s)."""
        return _DequantizeBlocks.apply(handle, self.data, self.scale)

    def rowwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows quantized rowwise, bit for bit `quantize_rows(self.dequantize(...))` (`requantize_rowwise`)."""
        return requantize_rowwise(self.data, self.scale)


def fp8_all_to_all_blocks(x: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                          group) -> tuple[torch.Tensor, Fp8Blocks]:
    """x's rows moved in FP8 as `all_to_all_single_autograd(x, recv_splits, send_splits)` moves them, kept in FP8:
    (a gradient handle, the received blocks). The handle [N_recv, D] holds no values (`_Fp8AllToAll`); a kernel
    gives it the gradient w.r.t. the received rows, which goes back to x straight-through."""
    handle, data, scale = _Fp8AllToAll.apply(x, recv_splits, send_splits, group)
    return handle, Fp8Blocks(data, scale)


def fp8_all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """`all_to_all_single_autograd(x, recv_splits, send_splits)` with the rows moved in FP8 and dequantized to
    x's dtype on arrival (module docstring)."""
    handle, blocks = fp8_all_to_all_blocks(x, recv_splits, send_splits, group)
    return blocks.dequantize(handle)
