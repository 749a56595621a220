"""Low-precision AdamW state (MS-AMP O2, Megatron's precision-aware optimizer): the dtypes of the two moments, the
fp8 first moment's block quantization, and what the state costs per parameter.

`optimizer.exp_avg_dtype` / `optimizer.exp_avg_sq_dtype` pick each moment's dtype apart from the master weights'
(`distributed.master_dtype`). The fp8 first moment is float8 e4m3 with one fp32 scale per block of 1 x 128 elements
along the last dim of the *global* tensor:

- **Power-of-two scales.** `block_scales` picks 2^k with amax / 2^k in (224, 448] (e4m3's largest finite value is
  448): dividing by the scale and multiplying back are exact in fp32, so dequantizing is exact, and quantizing a
  block that did not change (its values already e4m3 multiples of the scale) gives the same values back.
- **Blocks in global index space.** A block is 128 consecutive elements of one row of the global tensor, so a shard
  that does not cut a block (FSDP2 shards dim 0; TP's dim-1 shards of 128-multiples; EP's and PP's whole tensors)
  holds whole blocks, computes each block's scale exactly as one process does, and (with the hash-keyed
  stochastic rounding of trainer/optim/update.py) updates every element exactly as one process does. Tensors of one
  dim, whose last dim is not a multiple of 128, or whose layout cuts a block (a last-dim shard of a size that is
  not a multiple of 128) keep a bf16 first moment instead, counted in the startup line (`fp8_blocks`).
- **Stochastic rounding into e4m3** (`stochastic_round_to_e4m3`), with the exp_avg stream of the same hash bits as
  bf16 moments: e4m3 keeps 3 mantissa bits, so half an ulp is 3-6% of the value, while a step moves exp_avg by
  (1 - beta1) = 10% of (g - exp_avg): round to nearest freezes exp_avg once |g - exp_avg| < 0.3-0.6 |exp_avg|
  (a constant gradient stalls it at about 0.7 of its value: tests/unit/test_optim_states.py), stochastic rounding
  is unbiased. Its noise (at most an ulp, 6-12% of the value, per step, decaying by beta1) is below the gradient
  noise that exp_avg averages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from trainer.distributed import Layout, plain_tensor

QBLOCK = 128
"""Elements per fp8 block: 1 x 128 along the last dim of the global tensor."""
E4M3 = torch.float8_e4m3fn
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": E4M3}
SCALE_KEY = "exp_avg_scale"
"""The optimizer state entry holding an fp8 exp_avg's block scales (fp32, the parameter's shape with its last dim
divided by QBLOCK)."""


@dataclass(frozen=True)
class StateDtypes:
    """The resolved dtypes of the master weights and AdamW's two moments ("fp32", "bf16", "fp8")."""

    master: str
    exp_avg: str
    exp_avg_sq: str

    @classmethod
    def resolve(cls, *, bf16_master: bool, exp_avg: str = "auto", exp_avg_sq: str = "auto") -> StateDtypes:
        """'auto' is the master dtype (today's behaviour)."""
        master = "bf16" if bf16_master else "fp32"
        return cls(master, master if exp_avg == "auto" else exp_avg, master if exp_avg_sq == "auto" else exp_avg_sq)

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> StateDtypes:
        """Every state in the parameters' dtype: bf16 master weights if the first parameter is bf16, else fp32."""
        master = "bf16" if params and params[0].dtype == torch.bfloat16 else "fp32"
        return cls(master, master, master)

    @property
    def in_master_dtype(self) -> bool:
        """Both moments in the master dtype (the moments of plain AdamW)."""
        return self.exp_avg == self.master and self.exp_avg_sq == self.master

    def bytes_per_param(self, *, kahan: bool = False) -> dict[str, float]:
        """Optimizer-state bytes per parameter by entry (an fp8 exp_avg with its fp32 block scale: 1 + 4/128)."""
        size = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4 / QBLOCK}
        out = {"master": size[self.master], "exp_avg": size[self.exp_avg], "exp_avg_sq": size[self.exp_avg_sq]}
        if kahan:
            out["kahan"] = 2.0
        return out

    def describe_bytes(self, *, kahan: bool = False) -> str:
        """'master 2 + exp_avg 1.03 + exp_avg_sq 2 = 5.03 B/param'."""
        parts = self.bytes_per_param(kahan=kahan)
        return (" + ".join(f"{k} {v:.3g}" for k, v in parts.items()) + f" = {sum(parts.values()):.3g} B/param")


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The block scales' shape for a tensor of `shape` (its last dim a multiple of QBLOCK)."""
    return tuple(shape[:-1]) + (shape[-1] // QBLOCK,)


def fp8_blocks(p: torch.Tensor) -> bool:
    """Whether `p` (a plain tensor or DTensor) keeps an fp8 first moment: at least 2 dims, the last a multiple of
    QBLOCK, and no shard of its layout cutting a block. The same answer on every rank (from the global shape and
    the placements, not this rank's shard)."""
    if p.dim() < 2 or p.shape[-1] % QBLOCK:
        return False
    if not isinstance(p, DTensor):
        return True
    last = p.dim() - 1
    cutting = [i for i, pl in enumerate(p.placements) if pl.is_shard() and getattr(pl, "dim", None) == last]
    if not cutting:
        return True
    if len(cutting) > 1:  # the last dim sharded over two mesh axes: not worth the arithmetic
        return False
    return math.ceil(p.shape[-1] / p.device_mesh.size(cutting[0])) % QBLOCK == 0


def block_scales(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale 2^k of each block from its fp32 amax: amax / 2^k in (224, 448], so nothing overflows
    e4m3 (max 448) and the largest element keeps all of e4m3's range above it. k >= -126 (a normal fp32 scale;
    an all-zero block gets 2^-126). Integer arithmetic on the fp32 bits (the Triton kernel does the same)."""
    bits = amax.float().view(torch.int32)
    biased = (bits >> 23) & 0xFF  # amax = 1.f x 2^(biased - 127)
    over = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # 1.f > 1.75: amax / 2^(e - 8) would pass 448
    return (torch.clamp(biased - 8 + over, min=1) << 23).view(torch.float32)


def stochastic_round_to_e4m3(y: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """fp32 `y` (|y| <= 448) rounded to a neighbouring e4m3 value, up (in magnitude) with probability (the dropped
    fraction of an ulp, to 16 bits) -- returned in fp32, exactly representable in e4m3.

    The ulp is 2^(e - 3) for e4m3's normal range (|y| >= 2^-6) and 2^-9 below it (its subnormals); |y| / ulp,
    its floor and the remaining fraction are exact in fp32. A value already in e4m3 has fraction 0 and never moves.
    """
    a = y.abs()
    biased = (a.view(torch.int32) >> 23) & 0xFF
    ulp = ((torch.clamp(biased, min=127 - 6) - 3) << 23).view(torch.float32)
    x = a / ulp
    whole = torch.floor(x)
    up = ((x - whole) * 65536.0 > bits16.float()).float()
    return torch.copysign((whole + up) * ulp, y)


def quantize_blocks(x: torch.Tensor, bits16: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales) of fp32 `x` whose last dim is a multiple of QBLOCK: stochastic rounding with
    `bits16` (int32, x's shape), round to nearest without."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // QBLOCK, QBLOCK)
    scales = block_scales(blocks.abs().amax(dim=-1))
    y = blocks / scales.unsqueeze(-1)
    if bits16 is not None:
        y = stochastic_round_to_e4m3(y, bits16.reshape(y.shape))
    return y.to(E4M3).reshape(x.shape), scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, *, col_offset: int = 0) -> torch.Tensor:
    """fp32 values of e4m3 `q` with block `scales` (exact). col_offset: where q's columns start in the global
    tensor when `scales` holds every block of q's rows (a checkpoint's scales loaded whole)."""
    cols = q.shape[-1]
    if col_offset == 0 and scales.shape[-1] * QBLOCK == cols:
        return (q.float().reshape(*q.shape[:-1], -1, QBLOCK) * scales.unsqueeze(-1)).reshape(q.shape)
    block = (torch.arange(cols, device=q.device) + col_offset) // QBLOCK
    return q.float() * scales.float()[..., block]


def _dequantized_local(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values of this rank's shard of an fp8 exp_avg `q` (a DTensor or plain tensor). `scale` is sharded
    as q (whole blocks), or the whole global tensor of scales on every rank (a checkpoint's, staged on load)."""
    local_q, local_s = plain_tensor(q, local=True), plain_tensor(scale, local=True)
    if local_s.shape[-1] * QBLOCK == local_q.shape[-1] and local_s.shape[:-1] == local_q.shape[:-1]:
        return dequantize_blocks(local_q, local_s)
    offsets = Layout.of(q).offsets
    rows = tuple(slice(o, o + n) for o, n in zip(offsets[:-1], local_q.shape[:-1]))
    return dequantize_blocks(local_q, local_s[rows].to(local_q.device), col_offset=offsets[-1])


def convert_moment(target: torch.Tensor, target_scale: torch.Tensor | None, saved: torch.Tensor,
                   saved_scale: torch.Tensor | None) -> None:
    """Write a moment saved in another dtype (`saved`, an fp8 one with `saved_scale`) into this run's `target`
    (fp8 with `target_scale`), shard by shard: both sharded alike. Through fp32; into fp8 or bf16 to nearest (a
    one-off: the stochastic rounding of the updates then takes over)."""
    local_t = plain_tensor(target, local=True)
    values = (_dequantized_local(saved, saved_scale) if saved_scale is not None
              else plain_tensor(saved, local=True).float())
    if target_scale is None:
        local_t.copy_(values)
    elif local_t.numel():
        q, s = quantize_blocks(values)
        local_t.copy_(q)
        plain_tensor(target_scale, local=True).copy_(s)


def dtype_name(t: torch.Tensor, scale: torch.Tensor | None = None) -> str:
    """'fp8' for an fp8 moment with its scales, else 'fp32' / 'bf16' / the torch name."""
    if scale is not None or t.dtype == E4M3:
        return "fp8"
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(t.dtype, str(t.dtype).removeprefix("torch."))
