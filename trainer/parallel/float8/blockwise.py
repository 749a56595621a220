"""Blockwise FP8 (DeepSeek-V3 scales): 1x128 tiles for activations and gradients, 128x128 blocks for weights.

Real path: torchao's `fp8_blockwise_mm` (the autograd function of
`torchao.prototype.blockwise_fp8_training.linear.Float8BlockwiseLinear`) with `use_triton=False`: Triton
kernels quantize, `F.scaled_mm` (cuBLAS, SM90+) multiplies with per-tile scales. Emulated path
(`float8.emulate = true`, CPU and CI): the same quantize -> dequantize in plain torch, then an fp32 matmul.

The layouts torchao uses (block = 128; M tokens, K in_features, N out_features; each group's scale is
448 / amax, amax clamped to >= 1e-12 and the division done in float64, then fp32):

    forward  out    = x @ W.T      x: 1x128 groups along K      W: 128x128 blocks
    dgrad    grad_x = g @ W        g: 1x128 groups along N      W: 128x128 blocks (the same scales)
    wgrad    grad_W = g.T @ x      g: 128x1 groups along M      x: 128x1 groups along M

so every scale group lies inside one 128-slice of the contracting dim, which is what lets the GEMM apply
one scale per (tile, block) product. Values are scaled, clamped to +-448, rounded to float8_e4m3fn; the
GEMM multiplies by the reciprocal (fp32) of each scale.

With float8.weights_per_step the weight's 128x128 cast is made once per step (`BlockwiseFloat8Linear.cast_weight`,
by trainer.parallel.float8.weights_per_step) and every forward, recompute and dgrad of the step multiplies it:
the same blocks and scales serve both weight GEMMs, so the results are the per-use ones bit for bit.

The recipe's converter is `trainer.parallel.float8.linear.BlockwiseLinears`, which swaps this module in.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 128
_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = float(torch.finfo(_E4M3).max)  # 448
_EPS = 1e-12  # torchao.prototype.blockwise_fp8_training.kernels.EPS


def quantize_blocks(t: torch.Tensor, group: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` (2-D) as float8_e4m3fn with one scale per `group` (rows x cols) tile: (the e4m3 values, shaped as `t`; the
    fp32 reciprocal scale of each tile, (rows / group rows, cols / group cols): what the GEMM multiplies by).

    Both dims of `t` must be multiples of the group's. Numerics of torchao's blockwise quantization
    kernels: amax per group, scale = fp32(448 / float64(max(amax, 1e-12))), e4m3(clamp(t * scale, +-448)),
    reciprocal fp32(1 / scale).
    """
    rows, cols = t.shape
    gr, gc = group
    assert rows % gr == 0 and cols % gc == 0, (t.shape, group)
    tiles = t.float().reshape(rows // gr, gr, cols // gc, gc)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).double().clamp(min=_EPS)
    scale = (_E4M3_MAX / amax).float()
    q = (tiles * scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3)
    return q.reshape(rows, cols), (1.0 / scale).reshape(rows // gr, cols // gc)


def dequantize_blocks(q: torch.Tensor, inv_scale: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """`quantize_blocks`' output back in fp32: each e4m3 value times its tile's reciprocal scale."""
    rows, cols = q.shape
    gr, gc = group
    tiles = q.float().reshape(rows // gr, gr, cols // gc, gc)
    return (tiles * inv_scale.reshape(rows // gr, 1, cols // gc, 1)).reshape(rows, cols)


def quantize_dequantize(t: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """`t` (2-D) through float8_e4m3fn with one scale per `group` (rows x cols) tile, back in fp32."""
    return dequantize_blocks(*quantize_blocks(t, group), group)


def _weight_blocks(weight: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The weight through its 128x128 blocks, in fp32: cast here, or this step's kept cast (the same values)."""
    return quantize_dequantize(weight, (BLOCK, BLOCK)) if kept is None else dequantize_blocks(*kept, (BLOCK, BLOCK))


class EmulatedBlockwiseMM(torch.autograd.Function):
    """x @ w.T with blockwise FP8 numerics in forward and backward, in plain torch (fp32 matmuls). With this step's
    kept weight cast (`w_q`, `w_inv`: float8.weights_per_step) forward and dgrad multiply it instead of casting."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, w_q: torch.Tensor | None = None,
                w_inv: torch.Tensor | None = None) -> torch.Tensor:
        kept = None if w_q is None else (w_q, w_inv)
        ctx.kept, ctx.weight_dtype = kept is not None, weight.dtype
        ctx.save_for_backward(x, *(kept or (weight,)))  # a kept cast is saved instead of the weight
        out = quantize_dequantize(x, (1, BLOCK)) @ _weight_blocks(weight, kept).t()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *w = ctx.saved_tensors
        kept = tuple(w) if ctx.kept else None
        grad_x = quantize_dequantize(grad_out, (1, BLOCK)) @ _weight_blocks(w[0], kept)
        grad_w = quantize_dequantize(grad_out, (BLOCK, 1)).t() @ quantize_dequantize(x, (BLOCK, 1))
        return grad_x.to(x.dtype), grad_w.to(ctx.weight_dtype), None, None


# The real path as custom ops around torchao's autograd function (forward and backward, use_triton=False: Triton
# quantization kernels, cuBLAS F.scaled_mm, bf16 out): torch.compile treats each as one opaque call. Called
# inside a compiled block, torchao's autograd function itself fails to trace (dynamo cannot trace
# torch._scaled_mm_v2 inside an autograd.Function; 1x H100, torch 2.11).
@torch.library.custom_op("trainer::blockwise_fp8_mm", mutates_args=())
def blockwise_fp8_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in blockwise FP8 (x: 2-D, row-major, rows a multiple of 128), bf16 out."""
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    return fp8_blockwise_mm.apply(x, weight, BLOCK, torch.bfloat16, False)


@blockwise_fp8_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("trainer::blockwise_fp8_mm_backward", mutates_args=())
def blockwise_fp8_mm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of blockwise_fp8_mm: torchao's backward (1x128 gradient tiles for dgrad, 128x1 groups
    along the tokens for wgrad), bf16 out."""
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    ctx = SimpleNamespace(saved_tensors=(x, weight), block_size=BLOCK, out_dtype=torch.bfloat16, use_triton=False)
    grad_x, grad_weight, *_ = fp8_blockwise_mm.backward(ctx, grad)
    return grad_x, grad_weight


@blockwise_fp8_mm_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.bfloat16), weight.new_empty(weight.shape, dtype=torch.bfloat16)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = blockwise_fp8_mm_backward(grad.contiguous(), x, weight)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


blockwise_fp8_mm.register_autograd(_backward, setup_context=_setup_context)


# float8.weights_per_step's real path: the same GEMMs as torchao's fp8_blockwise_mm (torchao 0.18: its _scaled_mm, the
# use_triton=False path) with the weight's 128x128 cast made once per step (`cast_blocks_once`) instead of per use.
# Kept as torchao's forward makes it, (out, in) e4m3 row-major and (out/128, in/128) fp32 reciprocal scales row-major:
# their transposes are exactly the forward's operands; the dgrad wants the same values column-major, one byte-copy
# (no amax, no rounding) per backward. The weight is an input only for its gradient.
def cast_blocks_once(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out, in) cast by the kernel torchao's forward casts it with: (e4m3 (out, in), reciprocal scales)."""
    from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_weight_quant_transposed_rhs

    w_t, inv_t = triton_fp8_blockwise_weight_quant_transposed_rhs(weight.contiguous(), block_size=BLOCK)
    return w_t.t(), inv_t.t()


@torch.library.custom_op("trainer::blockwise_fp8_mm_kept", mutates_args=())
def blockwise_fp8_mm_kept(x: torch.Tensor, weight: torch.Tensor, w_q: torch.Tensor, w_inv: torch.Tensor
                          ) -> torch.Tensor:
    """blockwise_fp8_mm with the weight's kept cast (`cast_blocks_once`), bf16 out."""
    from torchao.prototype.blockwise_fp8_training.kernels import (
        BLOCKWISE_1X128_SCALING_TYPE, BLOCKWISE_128X128_SCALING_TYPE, triton_fp8_blockwise_act_quant_lhs)
    from torchao.prototype.blockwise_fp8_training.linear import _scaled_mm

    x_fp8, x_scale = triton_fp8_blockwise_act_quant_lhs(x, BLOCK)
    return _scaled_mm(x_fp8, w_q.contiguous().t(), x_scale, BLOCKWISE_1X128_SCALING_TYPE, w_inv.contiguous().t(),
                      BLOCKWISE_128X128_SCALING_TYPE, torch.bfloat16)


@blockwise_fp8_mm_kept.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, w_q: torch.Tensor, w_inv: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w_q.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("trainer::blockwise_fp8_mm_kept_backward", mutates_args=())
def blockwise_fp8_mm_kept_backward(grad: torch.Tensor, x: torch.Tensor, w_q: torch.Tensor, w_inv: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of blockwise_fp8_mm_kept: torchao's backward, the dgrad on the kept cast, bf16 out."""
    from torchao.prototype.blockwise_fp8_training.kernels import (
        BLOCKWISE_1X128_SCALING_TYPE, BLOCKWISE_128X128_SCALING_TYPE, triton_fp8_blockwise_act_quant_lhs,
        triton_fp8_blockwise_act_quant_rhs, triton_fp8_blockwise_act_quant_transposed_lhs)
    from torchao.prototype.blockwise_fp8_training.linear import _scaled_mm

    g_fp8, g_scale = triton_fp8_blockwise_act_quant_lhs(grad, BLOCK)
    w_cols, inv_cols = w_q.t().contiguous().t(), w_inv.t().contiguous().t()  # column-major, as torchao's dgrad casts
    grad_x = _scaled_mm(g_fp8, w_cols, g_scale, BLOCKWISE_1X128_SCALING_TYPE, inv_cols, BLOCKWISE_128X128_SCALING_TYPE,
                        torch.bfloat16)
    gt_fp8, gt_scale = triton_fp8_blockwise_act_quant_transposed_lhs(grad, BLOCK)
    x_fp8, x_scale = triton_fp8_blockwise_act_quant_rhs(x, BLOCK)
    grad_w = _scaled_mm(gt_fp8, x_fp8, gt_scale, BLOCKWISE_1X128_SCALING_TYPE, x_scale.transpose(-1, -2),
                        BLOCKWISE_1X128_SCALING_TYPE, torch.bfloat16)
    return grad_x, grad_w


@blockwise_fp8_mm_kept_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, w_q: torch.Tensor, w_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.bfloat16),
            x.new_empty((w_q.shape[0], x.shape[1]), dtype=torch.bfloat16))


def _setup_kept(ctx, inputs, output) -> None:
    x, weight, w_q, w_inv = inputs
    ctx.save_for_backward(x, w_q, w_inv)
    ctx.weight_dtype = weight.dtype


def _backward_kept(ctx, grad: torch.Tensor):
    x, w_q, w_inv = ctx.saved_tensors
    grad_x, grad_weight = blockwise_fp8_mm_kept_backward(grad.contiguous(), x, w_q, w_inv)
    return grad_x.to(x.dtype), grad_weight.to(ctx.weight_dtype), None, None


blockwise_fp8_mm_kept.register_autograd(_backward_kept, setup_context=_setup_kept)


def _padded(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` (2-D) with zero rows up to a multiple of 128, row-major (torchao's kernels need both); and the pad."""
    pad = -t.shape[0] % BLOCK
    return (F.pad(t, (0, 0, 0, pad)) if pad else t).contiguous(), pad


class BlockwiseRolesMM(torch.autograd.Function):
    """x @ weight.T with one role in blockwise FP8 and the other in high precision (float8.forward / backward).

    FP8 forward: the blockwise forward GEMM; bf16 forward: x @ weight.T. FP8 backward: the blockwise dgrad and
    wgrad from the saved high-precision x and weight; bf16 backward: dgrad = grad @ weight, wgrad = grad.T @ x
    from the same bf16 tensors (mm's own backward: a bf16 Linear's gradients), never the forward's FP8 casts.
    x is 2-D and unpadded: only the FP8 GEMMs pad its rows to a multiple of 128."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, forward_fp8: bool, emulate: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.forward_fp8, ctx.emulate = forward_fp8, emulate
        if not forward_fp8:
            return x.mm(weight.t())
        xp, pad = _padded(x)
        out = ((quantize_dequantize(xp, (1, BLOCK)) @ quantize_dequantize(weight, (BLOCK, BLOCK)).t()).to(x.dtype)
               if emulate else blockwise_fp8_mm(xp, weight).to(x.dtype))
        return out[: out.shape[0] - pad] if pad else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        if ctx.forward_fp8:  # the backward in high precision
            return grad.mm(weight), grad.t().mm(x), None, None
        xp, pad = _padded(x)
        gp, _ = _padded(grad)
        if ctx.emulate:
            grad_x = quantize_dequantize(gp, (1, BLOCK)) @ quantize_dequantize(weight, (BLOCK, BLOCK))
            grad_w = quantize_dequantize(gp, (BLOCK, 1)).t() @ quantize_dequantize(xp, (BLOCK, 1))
        else:
            grad_x, grad_w = blockwise_fp8_mm_backward(gp, xp, weight)
        grad_x = grad_x[: grad_x.shape[0] - pad] if pad else grad_x
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None, None


class BlockwiseFloat8Linear(nn.Linear):
    """nn.Linear whose matmul runs blockwise FP8 forward and backward; the weight (and a bias, added in the compute
    dtype: GPT-OSS's attention) stays high precision.

    Same parameters and state_dict as the nn.Linear it replaces, so checkpoints move freely between
    recipes and bf16. Any token count works: tokens are zero-padded to a multiple of 128 (torchao's wgrad
    needs it); a zero row changes no amax, so padding changes no value.
    """

    emulate: bool = False
    roles: tuple[str, str] = ("fp8", "fp8")
    """(float8.forward, float8.backward): with a bf16 role, BlockwiseRolesMM runs that role's GEMMs in bf16."""
    fp8_weight: tuple[torch.Tensor, torch.Tensor] | None = None
    """This step's 128x128 cast of the weight (e4m3 (out, in), fp32 reciprocal scale per block), set and dropped by
    `trainer.parallel.float8.weights_per_step.Fp8WeightsPerStep`; None: each use casts the weight itself."""

    @classmethod
    def from_linear(cls, mod: nn.Linear, *, emulate: bool, roles: tuple[str, str] = ("fp8", "fp8")
                    ) -> BlockwiseFloat8Linear:
        assert mod.in_features % BLOCK == 0 and mod.out_features % BLOCK == 0, mod
        mod.__class__ = cls  # in place: the same Parameter object (and any hooks); only forward changes
        mod.emulate, mod.roles = emulate, tuple(roles)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2d = x.reshape(-1, k)
        if self.roles != ("fp8", "fp8"):
            assert self.fp8_weight is None, "float8.weights_per_step with a bf16 role (the config check refuses it)"
            out = BlockwiseRolesMM.apply(x2d, self.weight, self.roles[0] == "fp8", self.emulate)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.reshape(*lead, out.shape[-1])
        pad = -x2d.shape[0] % BLOCK
        if pad:
            x2d = F.pad(x2d, (0, 0, 0, pad))
        x2d = x2d.contiguous()  # torchao's quantization kernels need row-major input
        kept = self.fp8_weight
        if self.emulate:
            out = EmulatedBlockwiseMM.apply(x2d, self.weight, *(kept or (None, None)))
        elif kept is not None:
            out = blockwise_fp8_mm_kept(x2d, self.weight, *kept).to(x.dtype)
        else:
            out = blockwise_fp8_mm(x2d, self.weight).to(x.dtype)
        if pad:
            out = out[: out.shape[0] - pad]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*lead, out.shape[-1])

    @torch.no_grad()
    def cast_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`weight` (the full weight in the dtype the forward sees) cast to 128x128 blocks as every use would cast
        it: the same e4m3 bytes and scales (float8.weights_per_step)."""
        return quantize_blocks(weight, (BLOCK, BLOCK)) if self.emulate else cast_blocks_once(weight)

    def extra_repr(self) -> str:
        roles = "" if self.roles == ("fp8", "fp8") else f", forward {self.roles[0]}, backward {self.roles[1]}"
        return f"{super().extra_repr()}, blockwise fp8 1x128/128x128{', emulated' if self.emulate else ''}{roles}"


def convert_to_blockwise(model: nn.Module, fqns: set[str], *, emulate: bool,
                         roles: tuple[str, str] = ("fp8", "fp8")) -> None:
    """Swap the nn.Linear modules named in `fqns` for BlockwiseFloat8Linear, in place."""
    for fqn in fqns:
        parent_fqn, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn)
        setattr(parent, name, BlockwiseFloat8Linear.from_linear(getattr(parent, name), emulate=emulate, roles=roles))
