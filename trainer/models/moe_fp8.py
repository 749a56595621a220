"""FP8 routed experts (`float8.moe_experts = "rowwise"`): the SwiGLU expert MLP as rowwise-scaled FP8 grouped GEMMs.

Per MoE layer and microbatch, with R rows in the padded expert order (`moe_permute.padded_layout`), D = dim,
H = moe_ffn_dim, E local experts:

    forward   rows' source [S, D] --quantize each row once--> e4m3 + scale [S] --gather--> xq [R, D] (fp8)
              h13 = scaled_grouped_mm(xq, W13)                  [R, 2H] bf16   (w1 || w3 as one GEMM)
              hq  = quantize_rows(silu(h1) * h3)                [R, H]  fp8    (fused: no bf16 h is stored)
              y   = scaled_grouped_mm(hq, W2)                   [R, D]  bf16
    backward  dgrad: the output gradient and d(h13), quantized rowwise (e4m3), times the weights quantized
              along their other dim; wgrad: bf16 grouped GEMMs (2-D x 2-D, grouped along rows) of the bf16
              gradient and the dequantized fp8 activations, i.e. the exact gradient of what the forward computed.

The source is the tokens themselves at ep=1 (each row quantized once, not once per chosen expert: 1/top_k of
the rows), or the rows the all-to-all received under EP. A rowwise scale depends on its row only, so gathering
quantized rows equals quantizing gathered rows, bit for bit; the bf16 permuted copy never exists. Padding rows
get a dequantization scale of 0 (their fp8 bytes are some real row's, so finite), which zeroes them in every GEMM.

Scales are powers of two (torchao's moe_training rounds them the same way): fp8 x 2^k is exact in bf16, so
the dequantized activations of wgrad and of the emulation are exactly what the FP8 GEMMs multiply.

`torch._scaled_grouped_mm` wants A row-major [M, K] with scale [M], B column-major [E, K, N] with scale [E, N],
fp32 dequantization scales, int32 group ends and bf16 out. A weight of Linear layout [E, N, K] quantized along
K is B transposed, as stored; the dgrad weight is quantized along N into a [E, K, N] copy, once.
`Fp8ExpertWeights` keeps both per optimizer step (see its docstring for FSDP).

`emulate=True` (CPU, CI) runs the same quantization, then dequantizes and multiplies with the plain
`torch._grouped_mm`: the same numerics up to the GEMMs' accumulation order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.models.moe_permute import padded_layout, select_unique_rows

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
AMAX_EPS = 1e-12  # torchao's floor on amax: an all-zero row gets a finite scale
# The FP8 GEMMs accumulate with Hopper's fast accumulation, as torchao's MoE training does for all three.
USE_FAST_ACCUM = True


def _fused_on_cuda(fn):
    """fn compiled on CUDA (one or two Triton kernels instead of a chain of eager ones), eager on CPU.

    Compiled even when the model is not: these elementwise passes are what separate quantization costs
    (MEASURED.md: torchao's eager path with separate passes is slower than bf16).
    """
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args)

    return run


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """E4M3_MAX / amax rounded down to a power of two (the float32 with its mantissa bits cleared)."""
    scale = E4M3_MAX / amax.float().clamp(min=AMAX_EPS)
    return (scale.view(torch.int32) & 0x7F800000).view(torch.float32)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    scale = _pow2_scale(x.abs().amax(dim=-1, keepdim=True))
    return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal().squeeze(-1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3 along the last dim: (fp8 data like x, fp32 dequantization scales x.shape[:-1]).

    x ~= data * scale[..., None]; the scale is a power of two, one per row.
    """
    return _quantize_fused(x)


_quantize_fused = _fused_on_cuda(_quantize)


@_fused_on_cuda
def _swiglu_quantize(h13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h1, h3 = h13.float().chunk(2, dim=-1)
    return _quantize(F.silu(h1) * h3)


@_fused_on_cuda
def _swiglu_backward_quantize(dh: torch.Tensor, h13: torch.Tensor):
    """d(silu(h1) * h3) -> (d(h13) in h13's dtype for wgrad, and it quantized rowwise for dgrad)."""
    h1, h3 = h13.float().chunk(2, dim=-1)
    dh = dh.float()
    sig = torch.sigmoid(h1)
    dh13 = torch.cat([dh * h3 * sig * (1 + h1 * (1 - sig)), dh * h1 * sig], dim=-1)
    return (dh13.to(h13.dtype), *_quantize(dh13))


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data * scale[..., None] in dtype (exact for bf16 and fp32: the scales are powers of two)."""
    return (data.float() * scale.unsqueeze(-1)).to(dtype)


@dataclass(frozen=True)
class QuantizedExperts:
    """One layer's expert weights in e4m3, each as (data, dequantization scale), in the layouts the GEMMs take.

    w13 [E, 2H, D] (w1 || w3) and w2 [E, D, H] quantized along their last dim (forward); w13_t [E, D, 2H] and
    w2_t [E, H, D], the transposes quantized along theirs (dgrad).
    """

    w13: tuple[torch.Tensor, torch.Tensor]
    w2: tuple[torch.Tensor, torch.Tensor]
    w13_t: tuple[torch.Tensor, torch.Tensor]
    w2_t: tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def quantize_expert_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> QuantizedExperts:
    w13 = torch.cat([w1, w3], dim=1)
    # Each data tensor contiguous: the GEMM takes its transpose as the column-major mat2 the kernel requires
    # (quantizing a transposed view would keep its strides: "Expected mat2 to be transposed" on the GPU).
    return QuantizedExperts(w13=quantize_rows(w13), w2=quantize_rows(w2.contiguous()),
                            w13_t=quantize_rows(w13.transpose(-2, -1).contiguous()),
                            w2_t=quantize_rows(w2.transpose(-2, -1).contiguous()))


class Fp8ExpertWeights:
    """A layer's expert weights in FP8, quantized once per optimizer step when `per_step`.

    Weights change only at the optimizer step, so every microbatch of a step (grad accumulation), the
    recompute of activation checkpointing and evaluation forwards reuse one quantization;
    `Fp8ExpertWeightsRefresh` (a step hook) drops it after each optimizer step. The copies cost 2 bytes per
    expert parameter (both orientations) and live through the step, so the build turns `per_step` on only
    when FSDP2 does not shard the experts (their FSDP mesh has one rank): with sharded experts they would pin
    an unsharded FP8 copy of every layer and undo the sharding; there each forward quantizes the weights it
    gathered (and backward the dgrad orientation again), freed with the activations.
    """

    def __init__(self, *, per_step: bool):
        self.per_step = per_step
        self.num_quantizations = 0  # tests and the benchmark count them
        self._cached: QuantizedExperts | None = None

    def get(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> QuantizedExperts:
        if self._cached is not None:
            return self._cached
        self.num_quantizations += 1
        quantized = quantize_expert_weights(w1, w2, w3)
        if self.per_step:
            self._cached = quantized
        return quantized

    def invalidate(self) -> None:
        self._cached = None


def _scaled_grouped_mm(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                       offs: torch.Tensor, *, dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """a [M, K] rowwise-fp8 times b[g]^T for b [G, N, K] quantized along K -> [M, N] in dtype."""
    (a_data, a_scale), (b_data, b_scale) = a, b
    if emulate:
        return torch._grouped_mm(dequantize(a_data, a_scale, dtype),
                                 dequantize(b_data, b_scale, dtype).transpose(-2, -1), offs=offs)
    assert dtype == torch.bfloat16, dtype  # the kernel writes bf16 only; FP8 runs compute in bf16
    return torch._scaled_grouped_mm(a_data, b_data.transpose(-2, -1), a_scale, b_scale, offs=offs,
                                    out_dtype=torch.bfloat16, use_fast_accum=USE_FAST_ACCUM)


def _wgrad(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per group g: grad[g rows]^T @ x[g rows] -> [G, N, K] (Linear layout), a bf16 grouped GEMM along rows."""
    return torch._grouped_mm(grad.transpose(0, 1), x, offs=offs)


@dataclass(frozen=True)
class RowPlan:
    """Index tensors of one call (no gradient): where each padded row comes from and where gradients go."""

    offs: torch.Tensor  # [E] int32 group ends in the padded buffer
    dst: torch.Tensor  # [N] padded row of each expert-order row
    data_rows: torch.Tensor  # [R] source row of each padded row (padding: row 0, any finite row)
    scale_rows: torch.Tensor  # [R] the same, padding -> S (the appended zero scale)
    grad_rows: torch.Tensor  # [S * k] padded row of each source row's k copies (dropped -> R, a zero row)
    k: int
    dropped: bool


@torch.no_grad()
def build_row_plan(counts: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, *, n_source: int, k: int,
                   align: int) -> RowPlan:
    """Rows in expert order are source[index] (counts[e] for expert e); inverse[s * k + j] is the expert-order
    position of source row s's j-th copy (>= len(index) when that copy was dropped)."""
    n_rows = index.shape[0]
    dst, offs, rows = padded_layout(counts, n_rows, align)
    scale_rows = torch.full((rows,), n_source, device=index.device, dtype=torch.int64).index_copy_(0, dst, index)
    data_rows = torch.where(scale_rows < n_source, scale_rows, 0)
    dst_or_zero_row = torch.cat([dst, dst.new_full((1,), rows)])
    grad_rows = dst_or_zero_row[inverse.clamp(max=n_rows)]
    return RowPlan(offs=offs, dst=dst, data_rows=data_rows, scale_rows=scale_rows, grad_rows=grad_rows, k=k,
                   dropped=n_rows < inverse.shape[0])


class _Fp8SwiGLU(torch.autograd.Function):
    """The expert MLP on the padded buffer: source rows [S, D] -> outputs [R, D] (padded expert order)."""

    @staticmethod
    def forward(ctx, src, w1, w2, w3, plan: RowPlan, weights: QuantizedExperts, emulate: bool):
        dtype = src.dtype
        data, scale = quantize_rows(src)
        if src.shape[0] == 0:  # an EP rank that received no rows: padding only
            data = data.new_zeros(1, src.shape[1])
        xq = (data.index_select(0, plan.data_rows),
              torch.cat([scale, scale.new_zeros(1)]).index_select(0, plan.scale_rows))
        h13 = _scaled_grouped_mm(xq, weights.w13, plan.offs, dtype=dtype, emulate=emulate)
        hq = _swiglu_quantize(h13)
        y = _scaled_grouped_mm(hq, weights.w2, plan.offs, dtype=dtype, emulate=emulate)
        ctx.save_for_backward(*xq, h13, *hq)
        ctx.plan, ctx.weights, ctx.emulate, ctx.n_source = plan, weights, emulate, src.shape[0]
        ctx.param_dtypes = (w1.dtype, w2.dtype, w3.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_data, x_scale, h13, h_data, h_scale = ctx.saved_tensors
        plan, weights, emulate = ctx.plan, ctx.weights, ctx.emulate
        dtype, hidden = h13.dtype, h13.shape[1] // 2
        grad_y = grad_y.contiguous()
        dh = _scaled_grouped_mm(quantize_rows(grad_y), weights.w2_t, plan.offs, dtype=dtype, emulate=emulate)
        dw2 = _wgrad(grad_y, dequantize(h_data, h_scale, dtype), plan.offs)
        dh13, *dh13_q = _swiglu_backward_quantize(dh, h13)
        dx = _scaled_grouped_mm(tuple(dh13_q), weights.w13_t, plan.offs, dtype=dtype, emulate=emulate)
        x = dequantize(x_data, x_scale, dtype)
        # w1 and w3 apart (strided views of dh13): their gradients come out contiguous, with no split copy.
        dw1, dw3 = (_wgrad(part, x, plan.offs) for part in (dh13[:, :hidden], dh13[:, hidden:]))
        if plan.dropped:
            dx = torch.cat([dx, dx.new_zeros(1, dx.shape[1])])  # dropped copies read this zero row
        d_src = dx.index_select(0, plan.grad_rows).view(ctx.n_source, plan.k, dx.shape[1]).sum(1)
        w1_dtype, w2_dtype, w3_dtype = ctx.param_dtypes
        return d_src, dw1.to(w1_dtype), dw2.to(w2_dtype), dw3.to(w3_dtype), None, None, None


@torch.compiler.disable
def fp8_grouped_swiglu(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor,
                       w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, *, k: int, weights: Fp8ExpertWeights,
                       emulate: bool, align: int) -> torch.Tensor:
    """`grouped_swiglu(src[index], counts, w1, w2, w3)` with FP8 GEMMs, quantizing src's rows once before the
    gather. inverse[s * k + j]: the position of source row s's j-th copy in expert order (dropped: >= N).

    Eager inside compiled blocks (its elementwise parts are compiled kernels of their own): a custom
    autograd.Function holding a weight cache is nothing dynamo should trace.
    """
    plan = build_row_plan(counts, index, inverse, n_source=src.shape[0], k=k, align=align)
    quantized = weights.get(w1, w2, w3)
    y = _Fp8SwiGLU.apply(src, w1, w2, w3, plan, quantized, emulate)
    return select_unique_rows(y, plan.dst)
