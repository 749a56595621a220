"""AdamW as one hand-written Triton kernel over every local tensor of a device and dtype: no compile per shape.

The compiled updates this replaces (torch.compile of the update, one graph per batch of tensor shapes) cost about
80 s of a cold start on 1x H100 at 8B shapes (docs/benchmarks.md, cold start), and their number grew with the
distinct shapes of a model. This kernel is compiled by Triton once per dtype and mode (about a second, then cached
on disk like any Triton kernel) and finds every tensor of a launch in a table of offsets: program i updates
BLOCK elements of one tensor, found in a block map built once per layout. One launch per step and dtype, whatever
the model; the update moves its bytes at 2.1 TB/s (bf16, stochastic rounding) to 2.9 TB/s (fp32) on an H100.

The arithmetic is the eager code's: `trainer.adamw.adamw_update` (torch's AdamW: decoupled weight decay, bias
correction, the lerp moments), and for bf16 master weights `trainer.bf16_adamw`'s roundings with the same random
bits (murmur3 finalizers of the element's index in the global tensor and the host's per-step key), so a run rounds
the same on every layout. Divisions and square roots round as IEEE (`div_rn`, `sqrt_rn`): the results differ from
torch's kernels only by the order of fp32 operations (tests/gpu/test_adamw_kernel_gpu.py; on CPU Triton's
interpreter runs the same kernel, tests/unit/test_adamw_kernel.py).

`triton` comes with torch's CUDA builds; nothing imports this module on a CPU run.
"""

from __future__ import annotations

import math
import time

import torch
import triton
import triton.language as tl

from trainer.adamw import Layout

# Columns of the per-tensor table (int64). Where the tensors are (in elements from the launch's first tensor of
# their dtype: the kernel's base pointers), then the local tensor as up to 3 dims
# (n0 x n1 x n2, leading dims of 1 added) with each dim's offset in the global tensor and the global tensor's
# contiguous strides, the global index of the first local element where the local tensor is one contiguous run
# of the global one (sharded on its first dim only), and the rounding's random keys.
_P, _G, _M, _V, _C, _STEP = (tl.constexpr(i) for i in range(6))
_NUMEL, _N1, _N2, _O0, _O1, _O2, _S0, _S1, _S2, _BASE, _CONTIG = (tl.constexpr(i) for i in range(6, 17))
_K0, _K1, _K2, _KHI = (tl.constexpr(i) for i in range(17, 21))
COLUMNS = 21

ROUND_NONE, ROUND_STOCHASTIC, ROUND_KAHAN = 0, 1, 2
# Elements per program and warps: 8 elements (one 16-byte bf16 vector) per thread. Larger blocks ran out of
# registers (4096 x 8 warps: 251 per thread, the stochastic update at 1.2 TB/s on 1x H100; docs/benchmarks.md).
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _hash32(x):
    """murmur3's 32-bit finalizer on uint32 (trainer.bf16_adamw._hash32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _bits16(lo, key_lo, key_hi):
    """trainer.bf16_adamw.random_bits16 with the host's (key + stream * c) & 0xFFFFFFFF and key >> 32."""
    x = _hash32(lo ^ key_lo)
    return (_hash32(x ^ key_hi) & 0xFFFF).to(tl.int32)


@triton.jit
def _stochastic_round(x, bits16):
    """trainer.bf16_adamw.stochastic_round_to_bf16."""
    bits = x.to(tl.int32, bitcast=True) + bits16
    return (bits & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _round_to_nearest(x):
    """trainer.bf16_adamw.round_to_nearest_bf16 (ties to even), as fp32: its cast to bf16 is exact. Not
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
def _tensor(base, row, column, ALIGN: tl.constexpr):
    """The tensor at `column` of the table: `base` plus its offset in elements, a multiple of ALIGN (16 bytes
    where the launch's tensors are all so aligned: the loads and stores are then 16-byte vectors)."""
    return base + tl.multiple_of(tl.load(row + column), ALIGN)


@triton.jit
def _update_block(
    row, local, numel, p_base, g_base, step_base, grad_scale_ptr,
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1, log2_beta2,
    P_DTYPE: tl.constexpr, ROUND: tl.constexpr, DEVICE_STEP: tl.constexpr, HAS_SCALE: tl.constexpr,
    P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, MASKED: tl.constexpr,
):
    """AdamW on the elements `local` of one tensor (MASKED: those below numel; else all of them)."""
    mask = local < numel
    p_ptr = _tensor(p_base, row, _P, P_ALIGN)
    m_ptr = _tensor(p_base, row, _M, P_ALIGN)
    v_ptr = _tensor(p_base, row, _V, P_ALIGN)
    p = _load(p_ptr + local, mask, MASKED)
    g = _load(_tensor(g_base, row, _G, G_ALIGN) + local, mask, MASKED)
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
        _store(m_ptr + local, _to(m, P_DTYPE), mask, MASKED)
        _store(v_ptr + local, _to(v, P_DTYPE), mask, MASKED)
        _store(p_ptr + local, _to(p + delta, P_DTYPE), mask, MASKED)
    else:
        # The element's index in the global tensor: its random bits are the same in every layout.
        if tl.load(row + _CONTIG) != 0:
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
        key_hi = tl.load(row + _KHI).to(tl.uint32)
        _store(m_ptr + local, _stochastic_round(m, _bits16(lo, tl.load(row + _K1).to(tl.uint32), key_hi)), mask, MASKED)
        _store(v_ptr + local, _stochastic_round(v, _bits16(lo, tl.load(row + _K2).to(tl.uint32), key_hi)), mask, MASKED)
        if ROUND == 1:
            new = _stochastic_round(p + delta, _bits16(lo, tl.load(row + _K0).to(tl.uint32), key_hi))
            _store(p_ptr + local, new, mask, MASKED)
        else:  # Kahan: round to nearest, keep what rounding dropped (trainer.bf16_adamw._update)
            c_ptr = _tensor(p_base, row, _C, P_ALIGN)
            y = delta + _load(c_ptr + local, mask, MASKED)
            p_new = _round_to_nearest(p + y)
            _store(c_ptr + local, _round_to_nearest(y - (p_new - p)).to(tl.bfloat16), mask, MASKED)
            _store(p_ptr + local, p_new.to(tl.bfloat16), mask, MASKED)


@triton.jit
def _adamw_kernel(
    table, block_tensor, block_index, p_base, g_base, step_base, grad_scale_ptr, found_inf_ptr,
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1, log2_beta2,
    P_DTYPE: tl.constexpr, ROUND: tl.constexpr, DEVICE_STEP: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr, P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr, NCOLS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program i: block block_index[i] of tensor block_tensor[i], a row of `table`. A full block runs unmasked
    (vector loads need it: a mask against a runtime length is not known to be constant over a vector)."""
    pid = tl.program_id(0)
    row = table + tl.load(block_tensor + pid).to(tl.int64) * NCOLS
    start = tl.load(block_index + pid).to(tl.int64) * BLOCK_SIZE
    local = start + tl.arange(0, BLOCK_SIZE)
    numel = tl.load(row + _NUMEL)
    if HAS_INF:  # a non-finite step changes nothing (the fused protocol): no element is live
        numel = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
    if start + BLOCK_SIZE <= numel:
        _update_block(row, local, numel, p_base, g_base, step_base, grad_scale_ptr, lr, beta1, beta2, eps,
                      weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1, log2_beta2, P_DTYPE, ROUND,
                      DEVICE_STEP, HAS_SCALE, P_ALIGN, G_ALIGN, MASKED=False)
    else:
        _update_block(row, local, numel, p_base, g_base, step_base, grad_scale_ptr, lr, beta1, beta2, eps,
                      weight_decay, bias_correction1, bias_correction2_sqrt, log2_beta1, log2_beta2, P_DTYPE, ROUND,
                      DEVICE_STEP, HAS_SCALE, P_ALIGN, G_ALIGN, MASKED=True)


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


def adamw_step(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    steps: list[torch.Tensor] | None = None, step: int | None = None,
    rounding: int = ROUND_NONE, comps: list[torch.Tensor] | None = None,
    layouts: list[Layout] | None = None, keys: list[int] | None = None,
) -> None:
    """One AdamW step of every tensor (plain, contiguous, one device; params, moments and compensations of one
    dtype, gradients of one dtype) in one launch.

    Either `steps` (each parameter's fp32 step tensor on the device, already counting this step: the fused
    protocol) or `step` (the host's step, for all). rounding=ROUND_STOCHASTIC / ROUND_KAHAN: bf16 tensors,
    `layouts` and `keys` (trainer.bf16_adamw.step_key of each parameter at this step) given; Kahan also `comps`.
    """
    global compile_seconds
    if not params:
        return
    device, p_dtype, g_dtype = params[0].device, params[0].dtype, grads[0].dtype
    assert (steps is None) != (step is None), "either device steps or the host step"
    assert (rounding != ROUND_NONE) == (layouts is not None and keys is not None)
    assert (rounding == ROUND_KAHAN) == (comps is not None)
    tensors = [params, grads, exp_avgs, exp_avg_sqs] + ([comps] if comps is not None else [])
    for i, p in enumerate(params):
        for t, dtype in zip([ts[i] for ts in tensors], (p_dtype, g_dtype, p_dtype, p_dtype, p_dtype)):
            assert t.device == device and t.dtype == dtype and t.is_contiguous() and t.numel() == p.numel(), (
                f"tensor {i}: {t.device} {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}, expected "
                f"{device} {dtype} {tuple(p.shape)}")
    p_base, g_base = params[0], grads[0]
    p_offsets = [_offsets(ts, p_base) for ts in (params, exp_avgs, exp_avg_sqs, comps or [p_base] * len(params))]
    g_offsets = _offsets(grads, g_base)
    step_offsets = _offsets(steps, steps[0]) if steps is not None else [0] * len(params)
    rows = []
    for i, p in enumerate(params):
        row = [p_offsets[0][i], g_offsets[i], p_offsets[1][i], p_offsets[2][i], p_offsets[3][i], step_offsets[i],
               p.numel()]
        if layouts is None:
            row += [1, 1] + [0] * 8 + [0, 0, 0, 0]
        else:
            key = keys[i]  # random_bits16's key per stream (0: weights, 1: exp_avg, 2: exp_avg_sq), and its high half
            row += _layout_columns(layouts[i], tuple(p.shape))
            row += [(key + stream * 0x632BE5AB) & 0xFFFFFFFF for stream in range(3)] + [key >> 32]
        assert len(row) == COLUMNS, row
        rows.append(row)
    block_tensor, block_index = _block_map(tuple(p.numel() for p in params), device)
    host_step = step if step is not None else 1
    p_align = _alignment([t for ts in tensors[:1] + tensors[2:] for t in ts])
    g_align = _alignment(grads)
    variant = (device, p_dtype, g_dtype, rounding, steps is not None, grad_scale is not None, found_inf is not None,
               p_align, g_align)
    first = variant not in _launched
    start = time.perf_counter()
    _adamw_kernel[(len(block_tensor),)](
        _device_table(rows, device), block_tensor, block_index, p_base, g_base,
        steps[0] if steps is not None else block_tensor,
        grad_scale if grad_scale is not None else block_tensor, found_inf if found_inf is not None else block_tensor,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        1.0 - beta1 ** host_step, (1.0 - beta2 ** host_step) ** 0.5, _log2(beta1), _log2(beta2),
        P_DTYPE=_TL_DTYPES[p_dtype], ROUND=rounding, DEVICE_STEP=steps is not None, HAS_SCALE=grad_scale is not None,
        HAS_INF=found_inf is not None, P_ALIGN=p_align, G_ALIGN=g_align, NCOLS=COLUMNS, BLOCK_SIZE=BLOCK,
        num_warps=NUM_WARPS,
    )
    if first:  # the first launch of a variant compiles it (or loads it from Triton's cache): host time
        _launched.add(variant)
        compile_seconds += time.perf_counter() - start
