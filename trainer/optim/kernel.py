"""AdamW as one hand-written Triton kernel over every local tensor of a device and dtype: no compile per shape.

The compiled updates this replaces (torch.compile of the update, one graph per batch of tensor shapes) cost about
80 s of a cold start on 1x H100 at 8B shapes (docs/benchmarks.md, cold start), and their number grew with the
distinct shapes of a model. This kernel is compiled by Triton once per dtype and mode (about a second, then cached
on disk like any Triton kernel) and finds every tensor of a launch in a table of offsets: program i updates
BLOCK elements of one tensor, found in a block map built once per layout. One launch per step and dtype, whatever
the model (two where tensor parallelism shards some weights by columns: adamw_step); the update moves its bytes at
3.3 TB/s (bf16, stochastic rounding) to 4.0 TB/s (fp32) on an H200 (docs/benchmarks.md, the optimizer step).

Each state is read and written in its own dtype (trainer.optim.adamw.AdamW's: fp32 or bf16 weights,
an fp32, bf16 or fp8 first moment, an fp32 or bf16 second moment); an fp8 first moment's program holds its 1024
elements as 8 rows of one 1 x 128 block each, takes each row's amax for its power-of-two scale and writes the e4m3
bytes by integer arithmetic (trainer/optim/states.py).

The arithmetic is the eager code's: `trainer.optim.update.adamw_update` (torch's AdamW: decoupled weight decay, bias
correction, the lerp moments), and for bf16 master weights `trainer.optim.update`'s roundings with the same random
bits (murmur3 finalizers of the element's index in the global tensor and the host's per-step key), so a run rounds
the same on every layout. Divisions and square roots round as IEEE (`div_rn`, `sqrt_rn`): the results differ from
torch's kernels only by the order of fp32 operations (tests/gpu/test_optim_kernel_gpu.py; on CPU Triton's
interpreter runs the same kernel, tests/unit/test_optim_kernel.py).

`triton` comes with torch's CUDA builds; nothing imports this module on a CPU run.
"""

from __future__ import annotations

import math
import time

import torch
import triton
import triton.language as tl

from trainer.distributed import Layout
from trainer.optim.update import STREAM_MIX as _MIX

# Columns of the per-tensor table (int64). Where the tensors are (in elements from the launch's first tensor of
# their kind: the kernel's base pointers; weights and Kahan buffers share one), then the local tensor as up to 3 dims
# (n0 x n1 x n2, leading dims of 1 added) with each dim's offset in the global tensor and the global tensor's
# contiguous strides, the global index of the first local element where the local tensor is one contiguous run
# of the global one (sharded on its first dim only), the rounding's random keys, and where an fp8 exp_avg's block
# scales are (from the launch's first scale tensor).
_P, _G, _M, _V, _C, _STEP = (tl.constexpr(i) for i in range(6))
_NUMEL, _N1, _N2, _O0, _O1, _O2, _S0, _S1, _S2, _BASE, _CONTIG = (tl.constexpr(i) for i in range(6, 17))
_KLO, _KHI, _S = (tl.constexpr(i) for i in range(17, 20))
COLUMNS = 20
STREAM_MIX: tl.constexpr = tl.constexpr(_MIX)  # exp_avg_sq's bits: a hash of the element's 32 bits XOR this
QB: tl.constexpr = tl.constexpr(128)  # an fp8 exp_avg's block: 1 x 128 elements (trainer.optim.states.QBLOCK)

ROUND_NONE, ROUND_STOCHASTIC, ROUND_KAHAN = 0, 1, 2
# Elements per program and warps: 8 elements (one 16-byte bf16 vector) per thread. Larger blocks ran out of
# registers (4096 x 8 warps: 251 per thread, the stochastic update at 1.2 TB/s on 1x H100; docs/benchmarks.md).
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _hash32(x):
    """murmur3's 32-bit finalizer on uint32 (trainer.optim.update._hash32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _bits32(lo, key_lo, key_hi):
    """trainer.optim.update.random_bits16's 32-bit hash of (index, key), from the host's key & 0xFFFFFFFF and
    key >> 32: its low half is the weights' stream, its high half exp_avg's."""
    return _hash32(_hash32(lo ^ key_lo) ^ key_hi)


@triton.jit
def _low16(x):
    return (x & 0xFFFF).to(tl.int32)


@triton.jit
def _stochastic_round(x, bits16):
    """trainer.optim.update.stochastic_round_to_bf16."""
    bits = x.to(tl.int32, bitcast=True) + bits16
    return (bits & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _round_to_nearest(x):
    """trainer.optim.update.round_to_nearest_bf16 (ties to even), as fp32: its cast to bf16 is exact. Not
    `.to(tl.bfloat16)`, which Triton's CPU interpreter truncates."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _to(x, DTYPE: tl.constexpr):
    """fp32 `x` rounded to nearest in DTYPE (bf16 by integer arithmetic, as torch's cast rounds)."""
    if DTYPE == tl.bfloat16:
        return _round_to_nearest(x).to(tl.bfloat16)
    return x.to(DTYPE)


@triton.jit
def _maximum(a, b):
    """The combine of a max reduction (not tl.max: a library @triton.jit, built before a test turns the
    interpreter on)."""
    return tl.maximum(a, b)


@triton.jit
def _block_scale(amax):
    """trainer.optim.states.block_scales: 2^k with amax / 2^k in (224, 448], k >= -126."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    over = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return (tl.maximum(biased - 8 + over, 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _stochastic_e4m3(y, bits16):
    """trainer.optim.states.stochastic_round_to_e4m3 (fp32 in, an e4m3 value as fp32 out)."""
    y_bits = y.to(tl.int32, bitcast=True)
    a = (y_bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    biased = (y_bits >> 23) & 0xFF
    ulp = ((tl.maximum(biased, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    x = tl.div_rn(a, ulp)  # exact: a power of two
    whole = tl.floor(x)
    up = ((x - whole) * 65536.0 > bits16.to(tl.float32)).to(tl.float32)
    q = (whole + up) * ulp
    return (q.to(tl.int32, bitcast=True) | (y_bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bytes(q):
    """An fp32 value that e4m3 represents exactly, as its e4m3 byte (by integer arithmetic: no fp8 type in the
    kernel, so Triton's CPU interpreter runs it too)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    biased = (bits >> 23) & 0xFF
    normal = sign | ((biased - 120) << 3) | ((bits >> 20) & 7)  # e4m3's exponent bias is 7: 127 - 7 = 120
    small = sign | (tl.abs(q) * 512.0).to(tl.int32)  # subnormals: multiples of 2^-9
    return tl.where(biased >= 121, normal, small).to(tl.uint8)


@triton.jit
def _e4m3_value(byte):
    """An e4m3 byte's value in fp32 (not NaN: the update never writes one)."""
    b = byte.to(tl.int32)
    sign = (b & 0x80) << 24
    e = (b >> 3) & 15
    mant = b & 7
    normal = (sign | ((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    small = (sign | (mant.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, small)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask).to(tl.float32)
    return tl.load(ptrs).to(tl.float32)


@triton.jit
def _store(ptrs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def _load_fp8(m_ptr, s_ptr, local, mask, MASKED: tl.constexpr):
    """An fp8 exp_avg's fp32 values: its e4m3 bytes times their block's scale."""
    if MASKED:
        byte = tl.load(m_ptr + local, mask=mask, other=0)
        scale = tl.load(s_ptr + local // QB, mask=mask, other=1.0)
    else:
        byte = tl.load(m_ptr + local)
        scale = tl.load(s_ptr + local // QB)
    return _e4m3_value(byte) * scale


@triton.jit
def _store_fp8(m_ptr, s_ptr, m, bits16, start, local, numel, mask, MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """fp32 `m` ((BLOCK_SIZE / 128) x 128: a block per row) as e4m3 bytes and a scale per row, from the row's amax
    (trainer.optim.states.quantize_blocks; rows past numel are whole rows: numel is a multiple of 128)."""
    scale = _block_scale(tl.reduce(tl.abs(tl.where(mask, m, 0.0)), 1, _maximum))
    q = _stochastic_e4m3(tl.div_rn(m, scale[:, None]), bits16)
    _store(m_ptr + local, _e4m3_bytes(q), mask, MASKED)
    block = start // QB + tl.arange(0, BLOCK_SIZE // QB)  # each row's block in the tensor's scales
    tl.store(s_ptr + block, scale, mask=block * QB < numel)


@triton.jit
def _tensor(base, row, column, ALIGN: tl.constexpr):
    """The tensor at `column` of the table: `base` plus its offset in elements, a multiple of ALIGN (16 bytes
    where the launch's tensors are all so aligned: the loads and stores are then 16-byte vectors)."""
    return base + tl.multiple_of(tl.load(row + column), ALIGN)


@triton.jit
def _update_block(
    row, start, local, numel, p_base, g_base, m_base, v_base, s_base, step_base, grad_scale_ptr,
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1, log2_beta2,
    P_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, M_FP8: tl.constexpr, ROUND: tl.constexpr,
    DEVICE_STEP: tl.constexpr, HAS_SCALE: tl.constexpr, P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    M_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr, CONTIG: tl.constexpr, MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """AdamW on the elements `local` of one tensor (MASKED: those below numel; else all of them). M_FP8: `local` is
    (BLOCK_SIZE / 128) x 128, one row per block of the fp8 exp_avg (its bytes at m_base, its scales at s_base).
    CONTIG: every tensor of the launch is one contiguous run of its global tensor (see adamw_step)."""
    mask = local < numel
    p_ptr = _tensor(p_base, row, _P, P_ALIGN)
    m_ptr = _tensor(m_base, row, _M, M_ALIGN)
    v_ptr = _tensor(v_base, row, _V, V_ALIGN)
    p = _load(p_ptr + local, mask, MASKED)
    g = _load(_tensor(g_base, row, _G, G_ALIGN) + local, mask, MASKED)
    s_ptr = s_base + tl.load(row + _S)  # M_FP8 only (else a dummy, never read)
    if M_FP8:
        m_old = _load_fp8(m_ptr, s_ptr, local, mask, MASKED)
    else:
        m_old = _load(m_ptr + local, mask, MASKED)
    v_old = _load(v_ptr + local, mask, MASKED)
    if HAS_SCALE:
        g = g * (1.0 / tl.load(grad_scale_ptr))
    if DEVICE_STEP:  # the state's step tensor (fp32 state, as torch's fused AdamW keeps it), already incremented
        step = tl.load(step_base + tl.load(row + _STEP))
        bc1 = 1.0 - tl.exp2(step * log2_beta1)
        bc2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
    else:
        bc1 = bias_correction1
        bc2_sqrt = bias_correction2_sqrt
    # Scalars once per program, one division per element (as torch's fused kernel: step_size = lr / bc1): IEEE
    # divisions are most of the arithmetic.
    step_size = lr / bc1
    inv_bc2_sqrt = 1.0 / bc2_sqrt
    m = m_old + (1.0 - beta1) * (g - m_old)  # torch's lerp for a weight below 0.5
    v = v_old + (1.0 - beta2) * (g * g - v_old)
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    delta = -(lr * weight_decay) * p - step_size * tl.div_rn(m, denom)
    if ROUND == 0:
        _store(m_ptr + local, _to(m, M_DTYPE), mask, MASKED)
        _store(v_ptr + local, _to(v, V_DTYPE), mask, MASKED)
        _store(p_ptr + local, _to(p + delta, P_DTYPE), mask, MASKED)
    else:
        # The element's index in the global tensor: its random bits are the same in every layout.
        if CONTIG:
            index = tl.load(row + _BASE) + local
        else:
            n1 = tl.load(row + _N1)
            n2 = tl.load(row + _N2)
            i2 = local % n2
            i1 = (local // n2) % n1
            i0 = local // (n1 * n2)
            index = ((i0 + tl.load(row + _O0)) * tl.load(row + _S0) + (i1 + tl.load(row + _O1)) * tl.load(row + _S1)
                     + (i2 + tl.load(row + _O2)) * tl.load(row + _S2))
        lo = (index & 0xFFFFFFFF).to(tl.uint32)
        bits = _bits32(lo, tl.load(row + _KLO).to(tl.uint32), tl.load(row + _KHI).to(tl.uint32))
        m_bits = (bits >> 16).to(tl.int32)
        if M_FP8:
            _store_fp8(m_ptr, s_ptr, m, m_bits, start, local, numel, mask, MASKED, BLOCK_SIZE)
        elif M_DTYPE == tl.bfloat16:
            _store(m_ptr + local, _stochastic_round(m, m_bits), mask, MASKED)
        else:
            _store(m_ptr + local, m, mask, MASKED)
        if V_DTYPE == tl.bfloat16:
            _store(v_ptr + local, _stochastic_round(v, _low16(_hash32(bits ^ STREAM_MIX))), mask, MASKED)
        else:
            _store(v_ptr + local, v, mask, MASKED)
        if P_DTYPE == tl.float32:  # fp32 master weights (moments of their own): no rounding to choose
            _store(p_ptr + local, p + delta, mask, MASKED)
        elif ROUND == 1:
            new = _stochastic_round(p + delta, _low16(bits))
            _store(p_ptr + local, new, mask, MASKED)
        else:  # Kahan: round to nearest, keep what rounding dropped (trainer.optim.update.update_rows)
            c_ptr = _tensor(p_base, row, _C, P_ALIGN)
            y = delta + _load(c_ptr + local, mask, MASKED)
            p_new = _round_to_nearest(p + y)
            _store(c_ptr + local, _round_to_nearest(y - (p_new - p)).to(tl.bfloat16), mask, MASKED)
            _store(p_ptr + local, p_new.to(tl.bfloat16), mask, MASKED)


@triton.jit
def _adamw_kernel(
    table, block_tensor, block_index, p_base, g_base, m_base, v_base, s_base, step_base, grad_scale_ptr,
    found_inf_ptr, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1,
    log2_beta2, P_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, M_FP8: tl.constexpr,
    ROUND: tl.constexpr, DEVICE_STEP: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
    P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, M_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr, CONTIG: tl.constexpr,
    NCOLS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Program i: block block_index[i] of tensor block_tensor[i], a row of `table`. A full block runs unmasked
    (vector loads need it: a mask against a runtime length is not known to be constant over a vector)."""
    pid = tl.program_id(0)
    row = table + tl.load(block_tensor + pid).to(tl.int64) * NCOLS
    start = tl.load(block_index + pid).to(tl.int64) * BLOCK_SIZE
    if M_FP8:  # one row per 1 x 128 block of the fp8 exp_avg
        local = start + tl.arange(0, BLOCK_SIZE // QB)[:, None] * QB + tl.arange(0, QB)[None, :]
    else:
        local = start + tl.arange(0, BLOCK_SIZE)
    numel = tl.load(row + _NUMEL)
    if HAS_INF:  # a non-finite step changes nothing (the fused protocol): no element is live
        numel = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
    if start + BLOCK_SIZE <= numel:
        _update_block(row, start, local, numel, p_base, g_base, m_base, v_base, s_base, step_base, grad_scale_ptr, lr,
                      beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1, log2_beta2,
                      P_DTYPE, M_DTYPE, V_DTYPE, M_FP8, ROUND, DEVICE_STEP, HAS_SCALE, P_ALIGN, G_ALIGN, M_ALIGN,
                      V_ALIGN, CONTIG, MASKED=False, BLOCK_SIZE=BLOCK_SIZE)
    else:
        _update_block(row, start, local, numel, p_base, g_base, m_base, v_base, s_base, step_base, grad_scale_ptr, lr,
                      beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1, log2_beta2,
                      P_DTYPE, M_DTYPE, V_DTYPE, M_FP8, ROUND, DEVICE_STEP, HAS_SCALE, P_ALIGN, G_ALIGN, M_ALIGN,
                      V_ALIGN, CONTIG, MASKED=True, BLOCK_SIZE=BLOCK_SIZE)


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf  # beta ** step == exp2(step * log2(beta)), 0 for beta = 0


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _layout_columns(layout: Layout, local_shape: tuple[int, ...]) -> list[int]:
    """The table's columns _N1.._CONTIG for a local tensor of `local_shape` (up to 3 dims) at `layout`."""
    assert len(local_shape) <= 3 and len(local_shape) == len(layout.global_shape), (local_shape, layout)
    pad = 3 - len(local_shape)
    shape, offsets = [1] * pad + list(local_shape), [0] * pad + list(layout.offsets)
    strides = [0] * pad + list(layout.strides)
    contiguous = list(local_shape[1:]) == list(layout.global_shape[1:])  # sharded on the first dim at most
    base = sum(o * s for o, s in zip(offsets, strides))
    return [shape[1], shape[2], *offsets, *strides, base, int(contiguous)]


compile_seconds = 0.0
"""Host seconds of this process's first launch of each kernel variant: Triton compiling it or loading its cache."""
_launched: set[tuple] = set()

_block_maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _block_map(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor of each program, its block within the tensor) for tensors of these sizes; built once per layout."""
    key = (numels, device, BLOCK)
    if key not in _block_maps:
        counts = torch.tensor([triton.cdiv(n, BLOCK) for n in numels], dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
        first = torch.cumsum(counts, 0) - counts
        index = torch.arange(len(tensor)) - first[tensor]
        _block_maps[key] = (tensor.to(device=device, dtype=torch.int32), index.to(device=device, dtype=torch.int32))
    return _block_maps[key]


def _offsets(tensors: list[torch.Tensor], base: torch.Tensor) -> list[int]:
    """Each tensor's start in elements from `base`'s (tensors of one dtype: their addresses differ by whole
    elements, as every allocation is aligned and a view starts at an element)."""
    size = base.element_size()
    out = []
    for t in tensors:
        diff = t.data_ptr() - base.data_ptr()
        assert diff % size == 0, (t.data_ptr(), base.data_ptr(), size)
        out.append(diff // size)
    return out


def _alignment(tensors: list[torch.Tensor]) -> int:
    """The largest element count dividing every tensor's address in 16-byte units (16 bytes: one vector load)."""
    size = tensors[0].element_size()
    align = 16 // size
    while align > 1 and any(t.data_ptr() % (align * size) for t in tensors):
        align //= 2
    return align


def _device_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """The table on the device without a host sync: through pinned memory (torch's caching host allocator keeps
    a pinned block until the copy that reads it has run)."""
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        return table
    return table.pin_memory().to(device, non_blocking=True)


def _table_rows(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, comps: list[torch.Tensor] | None, steps: list[torch.Tensor] | None,
                scales: list[torch.Tensor] | None, layouts: list[Layout] | None, keys: list[int] | None
                ) -> list[list[int]]:
    """The kernel's table: a row of COLUMNS per tensor (offsets from each kind's first tensor, its layout in the
    global tensor and its random keys; module comment at COLUMNS)."""
    p_base = params[0]
    p_offsets = [_offsets(ts, p_base) for ts in (params, comps or [p_base] * len(params))]
    m_offsets, v_offsets = _offsets(exp_avgs, exp_avgs[0]), _offsets(exp_avg_sqs, exp_avg_sqs[0])
    s_offsets = _offsets(scales, scales[0]) if scales is not None else [0] * len(params)
    g_offsets = _offsets(grads, grads[0])
    step_offsets = _offsets(steps, steps[0]) if steps is not None else [0] * len(params)
    rows = []
    for i, p in enumerate(params):
        row = [p_offsets[0][i], g_offsets[i], m_offsets[i], v_offsets[i], p_offsets[1][i], step_offsets[i],
               p.numel()]
        if layouts is None:  # no rounding, so no index: the tensor stands for its whole global tensor
            row += [1, 1] + [0] * 7 + [1] + [0, 0]
        else:
            key = keys[i]  # random_bits16's key: its low and high halves
            row += _layout_columns(layouts[i], tuple(p.shape))
            row += [key & 0xFFFFFFFF, key >> 32]
        row.append(s_offsets[i])
        assert len(row) == COLUMNS, row
        rows.append(row)
    return rows


def adamw_step(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    steps: list[torch.Tensor] | None = None, step: int | None = None,
    rounding: int = ROUND_NONE, comps: list[torch.Tensor] | None = None,
    layouts: list[Layout] | None = None, keys: list[int] | None = None, scales: list[torch.Tensor] | None = None,
) -> None:
    """One AdamW step of every tensor (plain, contiguous, one device; params and compensations of one dtype,
    gradients of one, exp_avgs of one, exp_avg_sqs of one) in one launch (two where some are column shards).

    Either `steps` (each parameter's fp32 step tensor on the device, already counting this step: the fused
    protocol) or `step` (the host's step, for all). rounding=ROUND_STOCHASTIC / ROUND_KAHAN: `layouts` and `keys`
    (trainer.optim.update.step_key of each parameter at this step) given, bf16 moments and weights rounded
    stochastically (Kahan: the weights to nearest, with `comps`), fp32 ones stored as computed. `scales`: the
    exp_avgs are float8 e4m3 with these fp32 block scales (trainer/optim/states.py; rounding given, every last
    dim a multiple of 128).
    """
    global compile_seconds
    if not params:
        return
    device, p_dtype, g_dtype = params[0].device, params[0].dtype, grads[0].dtype
    m_dtype, v_dtype = exp_avgs[0].dtype, exp_avg_sqs[0].dtype
    fp8 = scales is not None
    assert (steps is None) != (step is None), "either device steps or the host step"
    assert (rounding != ROUND_NONE) == (layouts is not None and keys is not None)
    assert (rounding == ROUND_KAHAN) == (comps is not None)
    assert (rounding != ROUND_NONE or (m_dtype == v_dtype == p_dtype)) and (not fp8 or rounding != ROUND_NONE)
    tensors = [params, grads, exp_avgs, exp_avg_sqs] + ([comps] if comps is not None else [])
    for i, p in enumerate(params):
        for t, dtype in zip([ts[i] for ts in tensors], (p_dtype, g_dtype, m_dtype, v_dtype, p_dtype)):
            assert t.device == device and t.dtype == dtype and t.is_contiguous() and t.numel() == p.numel(), (
                f"tensor {i}: {t.device} {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}, expected "
                f"{device} {dtype} {tuple(p.shape)}")
        if fp8:
            assert p.shape[-1] % QB.value == 0 and scales[i].is_contiguous() and scales[i].dtype == torch.float32 \
                and scales[i].numel() * QB.value == p.numel(), (i, tuple(p.shape), tuple(scales[i].shape))
    if fp8:
        exp_avgs = [m.view(torch.uint8) for m in exp_avgs]  # the kernel reads and writes e4m3 as bytes
    p_base, g_base, m_base, v_base = params[0], grads[0], exp_avgs[0], exp_avg_sqs[0]
    rows = _table_rows(params, grads, exp_avgs, exp_avg_sqs, comps=comps, steps=steps, scales=scales,
                       layouts=layouts, keys=keys)
    host_step = step if step is not None else 1
    aligns = [_alignment(ts) for ts in (params + (comps or []), grads, exp_avgs, exp_avg_sqs)]
    # One launch for the tensors that are one contiguous run of their global tensor (plain tensors, FSDP2's dim-0
    # shards: nearly all), one for the rest (TP's column shards): the general index arithmetic (64-bit divisions),
    # compiled into a launch that never runs it, cost the stochastic update a third of its speed (1x H200, 8B shapes
    # x 8 layers at dp_shard=2: 7.47 ms against 5.43).
    contig = [bool(row[_CONTIG.value]) for row in rows]
    for kind in (True, False):
        group = [i for i, c in enumerate(contig) if c == kind]
        if not group:
            continue
        block_tensor, block_index = _block_map(tuple(params[i].numel() for i in group), device)
        variant = (device, p_dtype, g_dtype, m_dtype, v_dtype, rounding, steps is not None, grad_scale is not None,
                   found_inf is not None, kind, *aligns)
        first = variant not in _launched
        start = time.perf_counter()
        _adamw_kernel[(len(block_tensor),)](
            _device_table([rows[i] for i in group], device), block_tensor, block_index, p_base, g_base, m_base,
            v_base, scales[0] if fp8 else block_tensor, steps[0] if steps is not None else block_tensor,
            grad_scale if grad_scale is not None else block_tensor,
            found_inf if found_inf is not None else block_tensor,
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            1.0 - beta1 ** host_step, (1.0 - beta2 ** host_step) ** 0.5, _log2(beta1), _log2(beta2),
            P_DTYPE=_TL_DTYPES[p_dtype], M_DTYPE=tl.uint8 if fp8 else _TL_DTYPES[m_dtype], V_DTYPE=_TL_DTYPES[v_dtype],
            M_FP8=fp8, ROUND=rounding, DEVICE_STEP=steps is not None, HAS_SCALE=grad_scale is not None,
            HAS_INF=found_inf is not None, P_ALIGN=aligns[0], G_ALIGN=aligns[1], M_ALIGN=aligns[2], V_ALIGN=aligns[3],
            CONTIG=kind, NCOLS=COLUMNS, BLOCK_SIZE=BLOCK, num_warps=NUM_WARPS,
        )
        if first:  # the first launch of a variant compiles it (or loads it from Triton's cache): host time
            _launched.add(variant)
            compile_seconds += time.perf_counter() - start
