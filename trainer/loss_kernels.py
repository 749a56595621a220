"""Triton kernels of the compiled FP8 output head's loss (trainer.loss.Float8HeadCrossEntropy): the cross-entropy's
row statistics, and its logits gradient cast to FP8 and written as is and transposed, each one pass over the
logits. trainer.loss's `row_stats_reference` and `logits_grad_reference` are their arithmetic in torch; `triton`
comes with torch's CUDA builds and nothing imports this module on a CPU run.

Tiles and warps: the fastest of those timed on 1x H200 at 8B shapes (16,384 x 128,256 bf16 logits, 4.2 GB):
the row statistics in 1.71 ms (2.5 TB/s; 1.72-2.22 ms for 1024-4096 logits a step and 2-8 warps), the gradient
in 2.83 ms (3.0 TB/s of the 8.4 GB it must move; 2.85-4.15 ms for the other tiles timed); the benchmark record
docs/benchmarks/2026-11-30-fused-fp8-head-loss-h200.md has them all.

On a GPU the roundings are the hardware's conversions (to nearest, ties to even, as torch's); under Triton's CPU
interpreter, whose casts truncate, the same roundings are integer arithmetic on the fp32 bits
(tests/unit/test_fused_head_loss.py runs the kernels there, tests/gpu/test_fused_head_loss_gpu.py on a GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

IGNORE: tl.constexpr = tl.constexpr(-100)  # trainer.loss.IGNORE_INDEX
# Under Triton's CPU interpreter (module docstring): integer roundings, which a GPU runs slower than its own
# conversions; both give the same bytes (0 differed on 1x H200, docs/benchmarks/2026-11-30-fused-fp8-head-loss-h200.md).
INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

ROW_BLOCK = 2048  # logits per loop step of the row kernel (4 warps: 16 per thread)
ROW_WARPS = 4
GRAD_TILE = (128, 64)  # rows x vocabulary columns per program of the gradient kernel
GRAD_WARPS = 4


@triton.jit
def _max(a, b):
    """The combine of a max reduction (not tl.max: a library @triton.jit, built before a test turns the interpreter
    on)."""
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_stats_kernel(logits_ptr, labels_ptr, lse_ptr, loss_ptr, amax_ptr, vocab, stride,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    valid = label != IGNORE
    target = tl.where(valid, label, 0)
    base = logits_ptr + row * stride
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    others = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.reduce(x, 0, _max))
        s = s * tl.exp(m - m_new) + tl.reduce(tl.exp(x - m_new), 0, _add)
        m = m_new
        others = tl.maximum(others, tl.reduce(tl.where(cols == target, float("-inf"), x), 0, _max))
    lse = m + tl.log(s)
    picked = tl.load(base + target).to(tl.float32)
    amax = tl.maximum(tl.exp(others - lse), tl.abs(tl.exp(picked - lse) - 1.0))
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    tl.store(amax_ptr + row, tl.where(valid, amax, 0.0))


@triton.jit
def _round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_bytes(v, MBITS: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr):
    """fp32 v, |v| <= the format's largest value, rounded to nearest even in an FP8 format of MBITS mantissa bits
    and exponent bias BIAS (e5m2: 2, 15; e4m3fn: 3, 7), as its byte; SUB = 2^(BIAS - 1 + MBITS), the inverse of
    the format's smallest subnormal."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    drop: tl.constexpr = 23 - MBITS
    mag = bits & 0x7FFFFFFF
    rounded = (mag + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)) >> drop  # exponent and MBITS mantissa bits
    normal = rounded - ((127 - BIAS) << MBITS)
    # Below the smallest normal (2^(1 - BIAS)): multiples of 2^(1 - BIAS - MBITS), rounded half to even; a carry
    # into the smallest normal's byte is that normal's encoding.
    scaled = tl.minimum(tl.abs(v) * SUB, 1024.0)  # only a subnormal's matters (below 2^MBITS); kept in int32
    whole = tl.floor(scaled)
    frac = scaled - whole
    k = whole.to(tl.int32)
    k = k + ((frac > 0.5) | ((frac == 0.5) & ((k & 1) == 1))).to(tl.int32)
    small = ((mag >> 23) & 0xFF) < (128 - BIAS)
    return (sign | tl.where(small, k, normal)).to(tl.uint8)


@triton.jit
def _grad_fp8_kernel(logits_ptr, lse_ptr, labels_ptr, g_ptr, scale_ptr, out_ptr, out_t_ptr, n, vocab,
                     TOP: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr,
                     OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    in_rows, in_cols = rows < n, cols < vocab
    mask = in_rows[:, None] & in_cols[None, :]
    x = tl.load(logits_ptr + rows[:, None] * vocab + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + rows, mask=in_rows, other=0.0)
    label = tl.load(labels_ptr + rows, mask=in_rows, other=IGNORE)
    d = tl.exp(x - lse[:, None]) - (cols[None, :] == label[:, None]).to(tl.float32)
    grad = tl.where((label != IGNORE)[:, None], d * tl.load(g_ptr).to(tl.float32), 0.0)
    if OUT_BF16:  # the gradient torchao would cast is the logits' dtype
        grad = _round_to_bf16(grad) if INTERPRETED else grad.to(tl.bfloat16).to(tl.float32)
    q = tl.minimum(tl.maximum(grad * tl.load(scale_ptr), -TOP), TOP)
    if INTERPRETED:
        q = _fp8_bytes(q, MBITS, BIAS, SUB)
    elif MBITS == 2:
        q = q.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        q = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(out_ptr + rows[:, None] * vocab + cols[None, :], q, mask=mask)
    tl.store(out_t_ptr + cols[:, None] * n + rows[None, :], tl.trans(q), mask=tl.trans(mask))


def row_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """trainer.loss.ce_row_stats on a GPU."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and labels.is_contiguous(), (logits.stride(), labels.stride())
    lse, loss, amax = (torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(3))
    if n:
        _row_stats_kernel[(n,)](logits, labels, lse, loss, amax, vocab, logits.stride(0), BLOCK=ROW_BLOCK,
                                num_warps=ROW_WARPS)
    return lse, loss, amax


def logits_grad_fp8(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, g: torch.Tensor,
                    scale: torch.Tensor, top: float, mbits: int, bias: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """trainer.loss.ce_logits_grad_fp8 on a GPU, for an FP8 format of largest value `top`, `mbits` mantissa bits
    and exponent bias `bias`."""
    n, vocab = logits.shape
    assert logits.is_contiguous() and labels.is_contiguous(), (logits.stride(), labels.stride())
    out = torch.empty((n, vocab), device=logits.device, dtype=torch.uint8)
    out_t = torch.empty((vocab, n), device=logits.device, dtype=torch.uint8)
    bm, bn = GRAD_TILE
    if n:
        _grad_fp8_kernel[(triton.cdiv(n, bm), triton.cdiv(vocab, bn))](
            logits, lse, labels, g, scale, out, out_t, n, vocab, TOP=top, MBITS=mbits, BIAS=bias,
            SUB=2.0 ** (bias - 1 + mbits), OUT_BF16=logits.dtype == torch.bfloat16, BM=bm, BN=bn, num_warps=GRAD_WARPS)
    return out.view(dtype), out_t.view(dtype)
