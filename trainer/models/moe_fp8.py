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
the rows), or the rows the all-to-all received under EP. With fp8 dispatch (`moe.dispatch_dtype = "fp8"`) those
arrive as e4m3 with 1x128 block scales and are requantized rowwise byte to byte (`trainer.models.moe_dispatch.
requantize_rowwise`, bit for bit the quantization of their bf16 copy, which is never made). A rowwise scale depends
on its row only, so gathering quantized rows equals quantizing gathered rows, bit for bit; the bf16 permuted copy
never exists. Padding rows
get a dequantization scale of 0 (their fp8 bytes are some real row's, so finite), which zeroes them in every GEMM.

Scales are powers of two (torchao's moe_training rounds them the same way): fp8 x 2^k is exact in bf16, so
the dequantized activations of wgrad and of the emulation are exactly what the FP8 GEMMs multiply.

`torch._scaled_grouped_mm` wants A row-major [M, K] with scale [M], B column-major [E, K, N] with scale [E, N],
fp32 dequantization scales, int32 group ends and bf16 out. A weight of Linear layout [E, N, K] quantized along
K is B transposed, as stored; the dgrad weight is quantized along N into a [E, K, N] copy. Forward quantizes
the one orientation, backward the other (`Fp8ExpertWeights`: kept per optimizer step only where a layer's
forward runs more than once per step).

`Fp8GroupedSwiGLU` is the experts' kernel (`trainer.models.moe_experts.ExpertKernel`) that runs all this;
`trainer.parallel.float8.experts.Fp8Experts` (the experts' FP8 converter) installs it.

`emulate=True` (CPU, CI) runs the same quantization, then dequantizes and multiplies with the plain
`torch._grouped_mm`: the same numerics up to the GEMMs' accumulation order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.models.moe_experts import GROUP_ALIGN, ExpertKernel, ExpertRows, GroupedSwiGLU
from trainer.models.moe_permute import padded_layout

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
AMAX_EPS = 1e-12  # torchao's floor on amax: an all-zero row gets a finite scale
# The FP8 GEMMs accumulate with Hopper's fast accumulation, as torchao's MoE training does for all three.
USE_FAST_ACCUM = True


def _fused_on_cuda(fn=None, *, dynamic: bool | None = None, mode: str | None = None):
    """fn compiled on CUDA (one or two Triton kernels instead of a chain of eager ones), eager on CPU.

    Compiled even when the model is not: these elementwise passes are what separate quantization costs
    (MEASURED.md: torchao's eager path with separate passes is slower than bf16). `dynamic=False` for
    functions of fixed shapes (the weights): a kernel specialized to the row length is faster than the
    dynamic-shape one that torch.compile switches to once the activations' row counts vary; `mode` as
    torch.compile's.
    """
    if fn is None:
        return functools.partial(_fused_on_cuda, dynamic=dynamic, mode=mode)
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=dynamic, mode=mode)
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
    return _dequantize_fused(data, scale, dtype)


def _dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale.unsqueeze(-1)).to(dtype)


_dequantize_fused = _fused_on_cuda(_dequantize)  # eager: an fp32 copy of the rows, then two more passes


@_fused_on_cuda
def _sum_copies(dx: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """out[s] = sum over j of dx[rows[s * k + j]]: each source row's gradient from its k expert copies."""
    return dx.index_select(0, rows).view(rows.shape[0] // k, k, dx.shape[1]).sum(1)


Quantized = tuple[torch.Tensor, torch.Tensor]  # (e4m3 data, fp32 dequantization scale per row)


# Every MoE layer's weights have the same shapes: one graph, specialized and autotuned (1x H200, moe_16b, both
# orientations of one layer: 1.41 ms autotuned vs 1.83 ms default, the same bytes; docs/benchmarks.md).
_WEIGHT_QUANT = dict(dynamic=False, mode="max-autotune-no-cudagraphs")


@_fused_on_cuda(**_WEIGHT_QUANT)
def quantize_forward_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[Quantized, Quantized]:
    """The forward GEMMs' weights: w13 [E, 2H, D] (w1 || w3) and w2 [E, D, H], quantized along their last dim
    (the reduction dim), contiguous: the GEMM takes each one's transpose as the column-major mat2."""
    return _quantize(torch.cat([w1, w3], dim=1)), _quantize(w2)


@_fused_on_cuda(**_WEIGHT_QUANT)
def quantize_dgrad_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[Quantized, Quantized]:
    """The dgrad GEMMs' weights: w13_t [E, D, 2H] and w2_t [E, H, D], the transposes quantized along their last
    dim, made contiguous (a transposed data tensor fails on the GPU: "Expected mat2 to be transposed")."""
    (w13_t, s13), (w2_t, s2) = (_quantize(torch.cat([w1, w3], dim=1).transpose(-2, -1)),
                                _quantize(w2.transpose(-2, -1)))
    return (w13_t.contiguous(), s13), (w2_t.contiguous(), s2)


class Fp8ExpertWeights:
    """A layer's expert weights in FP8: each orientation quantized where a GEMM first needs it.

    Forward needs (w13, w2), backward's dgrad (w13_t, w2_t) (`quantize_forward_weights`,
    `quantize_dgrad_weights`). Without `per_step` nothing is kept: forward quantizes its pair and frees it
    with the forward's temporaries, backward quantizes the other pair, so at most one layer's copy is alive
    (1 byte per expert parameter) and each weight is quantized once per forward + backward.
    With `per_step` both pairs are kept until the optimizer step (`Fp8ExpertWeightsRefresh`, a step hook,
    drops them): for layers whose forward runs more than once per step (gradient accumulation, pipeline
    microbatches, the recompute of activation checkpointing), at 2 bytes per expert parameter held through
    the step. The build turns `per_step` on only then, and only when FSDP2 does not shard the experts (their
    FSDP mesh has one rank): cached copies of sharded experts would pin them unsharded.
    """

    def __init__(self, *, per_step: bool):
        self.per_step = per_step
        self._cached: dict[str, tuple[Quantized, Quantized]] = {}
        self.open = True
        """Copies are kept and read only while open: in training, only inside a step's forward/backward
        (`Fp8ExpertWeightsRefresh` closes it between steps, so an evaluation there, maybe with train.ema_decay's
        average swapped in, quantizes what it multiplies and leaves nothing behind)."""

    def close(self) -> None:
        self.open = False
        self.invalidate()

    def forward(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[Quantized, Quantized]:
        return self._get("forward", quantize_forward_weights, w1, w2, w3)

    def dgrad(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[Quantized, Quantized]:
        return self._get("dgrad", quantize_dgrad_weights, w1, w2, w3)

    def _get(self, which: str, quantize, w1, w2, w3) -> tuple[Quantized, Quantized]:
        kept = self.per_step and self.open
        if kept and which in self._cached:
            return self._cached[which]
        with torch.no_grad():
            quantized = quantize(w1, w2, w3)
        if kept:
            self._cached[which] = quantized
        return quantized

    def invalidate(self) -> None:
        self._cached.clear()


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
    pad_src: torch.Tensor  # [R] expert-order row of each padded row (padding: row 0, any finite row)
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
    pad_src = torch.zeros(rows, device=index.device, dtype=torch.int64).index_copy_(
        0, dst, torch.arange(n_rows, device=index.device))
    return RowPlan(offs=offs, dst=dst, pad_src=pad_src, data_rows=data_rows, scale_rows=scale_rows,
                   grad_rows=grad_rows, k=k, dropped=n_rows < inverse.shape[0])


class _Fp8SwiGLU(torch.autograd.Function):
    """The expert MLP on the padded buffer: source rows [S, D] -> outputs [N, D] in expert order (unpadded).

    Backward pads the output gradient by one gather that fills each padding row with some real row's gradient
    (finite, not zero: no zero-filled buffer and scatter). Padding rows contribute nothing all the same: their
    inputs dequantize to exactly 0, so h13 = 0 there, d(h13) = dh * 0 = 0 and h = 0, which zeroes them in
    every weight gradient; their dx rows are never read.
    """

    @staticmethod
    def forward(ctx, src, w1, w2, w3, plan: RowPlan, weights: Fp8ExpertWeights, emulate: bool, blocks):
        dtype = src.dtype
        w13_q, w2_q = weights.forward(w1, w2, w3)
        # With fp8 dispatch src is a gradient handle and the rows are blocks, requantized rowwise in FP8, bit for bit
        # quantize_rows(their bf16 copy) (trainer.models.moe_dispatch), without that copy.
        data, scale = quantize_rows(src) if blocks is None else blocks.rowwise()
        if src.shape[0] == 0:  # an EP rank that received no rows: padding only
            data = data.new_zeros(1, src.shape[1])
        xq = (data.index_select(0, plan.data_rows),
              torch.cat([scale, scale.new_zeros(1)]).index_select(0, plan.scale_rows))
        h13 = _scaled_grouped_mm(xq, w13_q, plan.offs, dtype=dtype, emulate=emulate)
        hq = _swiglu_quantize(h13)
        y = _scaled_grouped_mm(hq, w2_q, plan.offs, dtype=dtype, emulate=emulate)
        # The weights themselves, not their FP8 forward copies: backward quantizes the other orientation.
        ctx.save_for_backward(*xq, h13, *hq, w1, w2, w3)
        ctx.plan, ctx.weights, ctx.emulate = plan, weights, emulate
        return y.index_select(0, plan.dst)

    @staticmethod
    def backward(ctx, grad_y):
        x_data, x_scale, h13, h_data, h_scale, w1, w2, w3 = ctx.saved_tensors
        plan, emulate = ctx.plan, ctx.emulate
        dtype, hidden = h13.dtype, h13.shape[1] // 2
        w13_t, w2_t = ctx.weights.dgrad(w1, w2, w3)
        if grad_y.shape[0]:
            grad_y = grad_y.index_select(0, plan.pad_src)
        else:  # an EP rank that received no rows: padding only
            grad_y = grad_y.new_zeros(plan.pad_src.shape[0], grad_y.shape[1])
        dh = _scaled_grouped_mm(quantize_rows(grad_y), w2_t, plan.offs, dtype=dtype, emulate=emulate)
        dw2 = _wgrad(grad_y, dequantize(h_data, h_scale, dtype), plan.offs)
        dh13, *dh13_q = _swiglu_backward_quantize(dh, h13)
        dx = _scaled_grouped_mm(tuple(dh13_q), w13_t, plan.offs, dtype=dtype, emulate=emulate)
        x = dequantize(x_data, x_scale, dtype)
        # w1 and w3 apart (strided views of dh13): their gradients come out contiguous, with no split copy.
        dw1, dw3 = (_wgrad(part, x, plan.offs) for part in (dh13[:, :hidden], dh13[:, hidden:]))
        if plan.dropped:
            dx = torch.cat([dx, dx.new_zeros(1, dx.shape[1])])  # dropped copies read this zero row
        d_src = _sum_copies(dx, plan.grad_rows, plan.k)
        return d_src, dw1.to(w1.dtype), dw2.to(w2.dtype), dw3.to(w3.dtype), None, None, None, None


@torch.compiler.disable
def fp8_grouped_swiglu(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor,
                       w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, *, k: int, weights: Fp8ExpertWeights,
                       emulate: bool, align: int, blocks=None) -> torch.Tensor:
    """`grouped_swiglu(src[index], counts, w1, w2, w3)` with FP8 GEMMs, quantizing src's rows once before the
    gather. inverse[s * k + j]: the position of source row s's j-th copy in expert order (dropped: >= N).
    blocks: fp8 dispatch's received rows (`ExpertRows.blocks`; src is their gradient handle), requantized rowwise.

    Eager inside compiled blocks (its elementwise parts are compiled kernels of their own): a custom
    autograd.Function holding a weight cache is nothing dynamo should trace.
    """
    plan = build_row_plan(counts, index, inverse, n_source=src.shape[0], k=k, align=align)
    return _Fp8SwiGLU.apply(src, w1, w2, w3, plan, weights, emulate, blocks)


class Fp8GroupedSwiGLU(ExpertKernel):
    """The FP8 rowwise experts' kernel: the rows' source quantized once, then gathered in FP8 (module docstring).

    `weights`: the layer's FP8 weight cache (kept through the optimizer step or not); `emulate`: dequantize and
    multiply in high precision (CPU, CI).
    """

    def __init__(self, weights: Fp8ExpertWeights, *, emulate: bool):
        self.weights, self.emulate = weights, emulate

    def __call__(self, rows: ExpertRows, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        return fp8_grouped_swiglu(rows.source, rows.index, rows.inverse, rows.counts, w1, w2, w3, k=rows.k,
                                  weights=self.weights, emulate=self.emulate, align=GROUP_ALIGN, blocks=rows.blocks)


class _RolesSwiGLU(torch.autograd.Function):
    """The expert MLP with one direction in FP8 and the other in bf16 (float8.forward / float8.backward): the
    forward kernel's output, and in backward exactly the backward kernel's gradients at the same inputs, found by
    running that kernel's forward again from the saved bf16 source rows and weights (never the forward's FP8
    copies). The price is one more forward of the expert GEMMs in backward, as activation checkpointing pays."""

    @staticmethod
    def forward(ctx, source, w1, w2, w3, forward_kernel, backward_kernel, rows):
        ctx.save_for_backward(source, w1, w2, w3)
        ctx.backward_kernel, ctx.rows = backward_kernel, rows
        return forward_kernel(rows(source), w1, w2, w3)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.backward_kernel(ctx.rows(inputs[0]), *inputs[1:])
        return (*torch.autograd.grad(out, inputs, grad), None, None, None)


class Fp8RolesSwiGLU(Fp8GroupedSwiGLU):
    """The FP8 experts' kernel with a bf16 role (float8.forward or float8.backward = 'bf16'): `_RolesSwiGLU` over
    the FP8 kernel and the bf16 one (`GroupedSwiGLU`). The same FP8 weight cache as the all-FP8 kernel."""

    def __init__(self, weights: Fp8ExpertWeights, *, emulate: bool, forward: str, backward: str):
        super().__init__(weights, emulate=emulate)
        assert {forward, backward} == {"fp8", "bf16"}, (forward, backward)
        self.forward, self.backward = forward, backward

    @torch.compiler.disable
    def __call__(self, rows: ExpertRows, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        fp8, bf16 = super().__call__, GroupedSwiGLU()
        kernels = (fp8, bf16) if self.forward == "fp8" else (bf16, fp8)
        rebuilt = functools.partial(ExpertRows, index=rows.index, inverse=rows.inverse, counts=rows.counts, k=rows.k)
        # fp8 dispatch's blocks dequantized: the bf16 kernel's backward reruns on the saved bf16 source rows.
        return _RolesSwiGLU.apply(rows.source_rows(), w1, w2, w3, *kernels, rebuilt)
