"""The AdamW update as eager torch: the arithmetic every path shares, the roundings into bf16, and their random bits.

`adamw_update` is one step of AdamW (decoupled weight decay, bias correction) in fp32; `update_rows` applies it to
rows of one local tensor in place, each state stored in its own dtype (fp32 as computed, bf16 and fp8 rounded
stochastically). It is the CPU path of trainer.optim.adamw.AdamW and the reference of the Triton kernel
(trainer/optim/kernel.py), which draws the same random bits.

Plain AdamW on bf16 weights rounds `p + update` to the nearest bf16: an update below
half a bf16 ulp of the weight (2^-9 of it, ~0.2%) rounds away, every step, so a
weight whose updates are all that small never moves. With bf16 master weights the update
is computed in fp32 from the stored state and then either

- "stochastic": rounds `p + update` to bf16 up or down with probability proportional
  to the distance, so the expected new weight is exactly the fp32 one; or
- "kahan": rounds to nearest and keeps what rounding dropped in a bf16 compensation
  buffer that is added to the next update (one extra bf16 buffer per weight).

The moments (exp_avg, exp_avg_sq) are stored in bf16 with stochastic rounding in both
modes: with beta2 = 0.999 a round-to-nearest exp_avg_sq can never shrink
(its change, 0.1% of the gap, is below half an ulp).

Why not torchao.optim._AdamW(bf16_stochastic_round=True): it draws its random bits
from the global RNG (so a resume repeats them only if the RNG state is restored at
the same point, and every rank's draws depend on the layout), takes no grad_scale /
found_inf (our fused path divides by the loss scale times the clip factor and skips a
non-finite step on the device), needs a tensor lr, and always torch.compiles one kernel
per parameter.

Random bits here are a hash of (seed, step, the parameter's fqn, the element's index in
the *global* tensor): no generator state to checkpoint, so a resumed run rounds exactly as
the uninterrupted one, and every layout (FSDP, HSDP, TP, EP, each pipeline stage holding
some of the parameters) rounds each element exactly as one process does (replicas of an
HSDP shard stay identical). The fqn enters as its crc32, a stable hash (Python's `hash()`
of a string differs between processes).
"""

from __future__ import annotations

import zlib

import torch

from trainer.optim.states import dequantize_blocks, quantize_blocks


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


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), in two products that cannot overflow int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer: a bijection of [0, 2^32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


STREAM_MIX = 0x632BE5AB
"""XORed into an element's 32 bits before the hash that gives the exp_avg_sq stream its own bits."""


def random_bits16(index: torch.Tensor, key: torch.Tensor, stream: int) -> torch.Tensor:
    """16 uniform random bits (int32) per element, a pure function of (index, key, stream): stream 0 (the weights)
    and 1 (exp_avg) are the two halves of one 32-bit hash of (index, key), stream 2 (exp_avg_sq) a hash of that hash.
    Three 32-bit hashes an element for all three streams, where one of its own per stream took six: the Triton
    kernel's stochastic update is bound by this integer arithmetic on an H200 (docs/benchmarks.md, the optimizer
    step)."""
    return _stream_bits(_element_hash(index, key), stream)


def _element_hash(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of (index, key) every stream of random_bits16 is drawn from."""
    return _hash32(_hash32((index & _M32) ^ (key & _M32)) ^ (key >> 32))


def _stream_bits(x: torch.Tensor, stream: int) -> torch.Tensor:
    """random_bits16's `stream` from its element hash `x`."""
    if stream == 2:
        x = _hash32(x ^ STREAM_MIX)
    return ((x >> 16) if stream == 1 else (x & 0xFFFF)).to(torch.int32)


def stochastic_round_to_bf16(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """Round fp32 `x` to bf16, away from zero with probability (dropped 16 bits) / 2^16.

    Adding 16 random bits below the bf16 mantissa, then truncating, carries into the
    kept bits exactly that often; on the int32 view of a negative float the addition
    grows the magnitude too, so the rounding is unbiased for either sign.
    """
    bits = x.view(torch.int32) + bits16
    return (bits & -65536).view(torch.float32).to(torch.bfloat16)


def round_to_nearest_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to the nearest bf16 (ties to even), still as fp32, by integer arithmetic.

    Not `x.to(bfloat16).float()`: inductor keeps that round trip in fp32 unless
    emulate_precision_casts is set, and Kahan's compensation would then be always zero.
    """
    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def param_key(name: str) -> int:
    """A parameter's stable 32-bit key: the crc32 of its fqn (the same in every process and layout)."""
    return zlib.crc32(name.encode())


def step_key(seed: int, key: int, step: int) -> int:
    """Host-side key of one parameter's random bits at one step (63 bits, fits int64)."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ key) ^ step) >> 1


def global_index(shape: tuple[int, ...], offsets: torch.Tensor, strides: torch.Tensor) -> torch.Tensor:
    """int64 index of each local element in the flattened global tensor."""
    idx = torch.zeros((), dtype=torch.int64, device=offsets.device)
    for d, n in enumerate(shape):
        r = (torch.arange(n, device=offsets.device) + offsets[d]) * strides[d]
        idx = idx + r.view([n if i == d else 1 for i in range(len(shape))])
    return idx


CHUNK_ELEMENTS = 1 << 22
"""Elements per chunk of the eager update: its ~10 fp32/int64 temporaries stay near 200 MB per chunk."""


def _store(dst: torch.Tensor, value: torch.Tensor, bits: torch.Tensor | None) -> None:
    """fp32 `value` into `dst`: bf16 rounded with `bits` (stochastic; to nearest without), fp32 as is."""
    if dst.dtype == torch.bfloat16:
        dst.copy_(stochastic_round_to_bf16(value, bits) if bits is not None else value)
    else:
        dst.copy_(value)


def update_rows(p, grad, m, m_scale, v, comp, index, key, lr, bc1, bc2_sqrt, grad_scale, found_inf, *, beta1,
                 beta2, eps, weight_decay) -> None:
    """One AdamW step of one chunk of rows, in place (m_scale: the fp8 exp_avg's block scales, else None)."""
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale
    p32, v_old = p.float(), v.float()
    m_old = dequantize_blocks(m, m_scale) if m_scale is not None else m.float()
    m_new, v_new, delta = adamw_update(p32, g, m_old, v_old, lr=lr, bias_correction1=bc1,
                                       bias_correction2_sqrt=bc2_sqrt, beta1=beta1, beta2=beta2, eps=eps,
                                       weight_decay=weight_decay)
    keep = None if found_inf is None else found_inf == 0  # a skipped step leaves every tensor as it was
    bits32 = _element_hash(index, key)  # every stream's random bits are drawn from it
    if m_scale is not None:
        q, s = quantize_blocks(m_new, _stream_bits(bits32, 1))
        if keep is not None:
            q, s = torch.where(keep, q.view(torch.uint8), m.view(torch.uint8)).view(m.dtype), torch.where(keep, s,
                                                                                                        m_scale)
        m.copy_(q)
        m_scale.copy_(s)
    else:
        _store(m, m_new if keep is None else torch.where(keep, m_new, m_old), _stream_bits(bits32, 1))
    _store(v, v_new if keep is None else torch.where(keep, v_new, v_old), _stream_bits(bits32, 2))
    if keep is not None:
        delta = torch.where(keep, delta, 0.0)
    if p.dtype == torch.float32:
        p.add_(delta)
    elif comp is None:
        p.copy_(stochastic_round_to_bf16(p32 + delta, _stream_bits(bits32, 0)))
    else:  # Kahan: round to nearest, keep what rounding dropped (exact in fp32)
        c_old = comp.float()
        y = delta + c_old
        p_new = round_to_nearest_bf16(p32 + y)
        c = y - (p_new - p32)  # what rounding to nearest dropped (exact in fp32)
        if keep is not None:
            c, p_new = torch.where(keep, c, c_old), torch.where(keep, p_new, p32)
        comp.copy_(c.to(torch.bfloat16))
        p.copy_(p_new.to(torch.bfloat16))
