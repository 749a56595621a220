"""AdamW for bf16 master weights that does not lose small updates.

Plain AdamW on bf16 weights rounds `p + update` to the nearest bf16: an update below
half a bf16 ulp of the weight (2^-9 of it, ~0.2%) rounds away, every step, so a
weight whose updates are all that small never moves. `BF16AdamW` computes the update
in fp32 from bf16 state and then either

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

import functools
import zlib
from collections.abc import Sequence
from typing import Literal

import torch

from trainer.distributed import Layout, plain_tensor

_local = functools.partial(plain_tensor, local=True)  # the plain tensor an optimizer updates in place

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


BF16Update = Literal["stochastic", "kahan"]

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


def random_bits16(index: torch.Tensor, key: torch.Tensor, stream: int) -> torch.Tensor:
    """16 uniform random bits (int32) per element, a pure function of (index, key, stream)."""
    x = _hash32((index & _M32) ^ ((key + stream * 0x632BE5AB) & _M32))
    return (_hash32(x ^ (key >> 32)) & 0xFFFF).to(torch.int32)


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


def _update(
    p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    comp: torch.Tensor | None, offsets: torch.Tensor, strides: torch.Tensor, key: torch.Tensor,
    lr: torch.Tensor, bias_correction1: torch.Tensor, bias_correction2_sqrt: torch.Tensor,
    grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
    *, beta1: float, beta2: float, eps: float, weight_decay: float,
) -> None:
    """One AdamW step of one (local) bf16 tensor, in place; fp32 arithmetic, rounding as above."""
    index = global_index(tuple(p.shape), offsets, strides)
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale
    m_old, v_old, p32 = exp_avg.float(), exp_avg_sq.float(), p.float()
    m, v, delta = adamw_update(p32, g, m_old, v_old, lr=lr, bias_correction1=bias_correction1,
                               bias_correction2_sqrt=bias_correction2_sqrt, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay)
    if found_inf is not None:
        # A skipped (non-finite) step leaves everything as it was: each value below is
        # then exactly representable in bf16, so rounding it returns the old tensor.
        keep = found_inf == 0
        m, v = torch.where(keep, m, m_old), torch.where(keep, v, v_old)
        delta = torch.where(keep, delta, 0.0)
    exp_avg.copy_(stochastic_round_to_bf16(m, random_bits16(index, key, 1)))
    exp_avg_sq.copy_(stochastic_round_to_bf16(v, random_bits16(index, key, 2)))
    if comp is None:
        p.copy_(stochastic_round_to_bf16(p32 + delta, random_bits16(index, key, 0)))
        return
    c_old = comp.float()
    y = delta + c_old
    p_new = round_to_nearest_bf16(p32 + y)
    c = y - (p_new - p32)  # what rounding to nearest dropped (exact in fp32)
    if found_inf is not None:
        c = torch.where(found_inf == 0, c, c_old)
        p_new = torch.where(found_inf == 0, p_new, p32)
    comp.copy_(c.to(torch.bfloat16))
    p.copy_(p_new.to(torch.bfloat16))  # exact: p_new is a bf16 value


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) for bf16 parameters, without losing small updates.

    Follows the fused torch AdamW protocol the trainer uses: set `grad_scale` (gradients
    are divided by it) and `found_inf` (a nonzero value skips the step on the device,
    leaving weights and state unchanged) before `step()`. The step counter (state "step",
    a CPU tensor) counts calls, skipped ones included; it seeds the rounding, so it does
    not wait on the device.

    triton=True: every tensor of a device and step in one launch of the Triton kernel (trainer/optim/kernel.py;
    the trainer's choice on a GPU); False: `_update` per tensor, eagerly (a CPU).
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 update: BF16Update, seed: int, triton: bool = False, names: Sequence[str] | None = None):
        """names: each parameter's fqn, in the order of `params` (the trainer passes the model's fqns without
        compile/AC wrapper names); it keys the rounding's random bits. None: the position ("0", "1", ...)."""
        assert update in ("stochastic", "kahan"), update
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.update, self.seed, self.triton = update, seed, triton
        flat = [p for group in self.param_groups for p in group["params"]]
        names = list(names) if names is not None else [str(i) for i in range(len(flat))]
        assert len(names) == len(flat), (len(names), len(flat))
        self._keys = {p: param_key(name) for p, name in zip(flat, names)}
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        self._layouts: dict[torch.Tensor, Layout] = {}
        self._index_meta: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}

    def _layout(self, p: torch.Tensor) -> Layout:
        if p not in self._layouts:
            self._layouts[p] = Layout.of(p)
        return self._layouts[p]

    def _meta(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """p's layout as the eager update takes it: (offsets, strides) int64 tensors on p's device; cached."""
        if p not in self._index_meta:
            layout, dev = self._layout(p), _local(p).device
            self._index_meta[p] = (torch.tensor(list(layout.offsets), dtype=torch.int64, device=dev),
                                   torch.tensor(list(layout.strides), dtype=torch.int64, device=dev))
        return self._index_meta[p]

    def _state(self, p: torch.Tensor) -> dict:
        assert p.dtype == torch.bfloat16, f"BF16AdamW needs bf16 parameters, got {p.dtype}"
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if self.update == "kahan" and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        return state

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "BF16AdamW takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            steps = [int(self._state(p)["step"].item()) for p in params]  # CPU tensors: no device sync
            (self._triton_step if self.triton else self._eager_step)(group, params, steps)
        return None

    def _eager_step(self, group: dict, params: list[torch.Tensor], steps: list[int]) -> None:
        beta1, beta2 = group["betas"]
        lr, kahan = torch.tensor(float(group["lr"])), self.update == "kahan"
        for p, step in zip(params, steps):
            state, (offsets, strides) = self.state[p], self._meta(p)
            _update(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                    _local(state["kahan_comp"]) if kahan else None, offsets, strides,
                    torch.tensor(step_key(self.seed, self._keys[p], step), dtype=torch.int64),
                    lr, torch.tensor(1 - beta1**step), torch.tensor((1 - beta2**step) ** 0.5),
                    self.grad_scale, self.found_inf,
                    beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _triton_step(self, group: dict, params: list[torch.Tensor], steps: list[int]) -> None:
        launches: dict[tuple, list[torch.Tensor]] = {}  # one launch per device, gradient dtype and step (normally one)
        for p, step in zip(params, steps):
            launches.setdefault((_local(p).device, _local(p.grad).dtype, step), []).append(p)
        for (device, _, step), ps in launches.items():
            self._launch(group, ps, device=device, step=step, kahan=self.update == "kahan")

    def _launch(self, group: dict, ps: list[torch.Tensor], *, device: torch.device, step: int, kahan: bool,
                scale_key: str | None = None) -> None:
        """One launch of the Triton kernel (trainer/optim/kernel.py) over these parameters, all on `device` at
        `step`; `scale_key`: the state entry of an fp8 first moment's block scales (LowPrecisionAdamW)."""
        import trainer.optim.kernel as adamw_kernel

        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in ps]
        adamw_kernel.adamw_step(
            [_local(p) for p in ps], [_local(p.grad) for p in ps], [_local(s["exp_avg"]) for s in states],
            [_local(s["exp_avg_sq"]) for s in states], lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"],
            grad_scale=None if self.grad_scale is None else self.grad_scale.to(device),
            found_inf=None if self.found_inf is None else self.found_inf.to(device), step=step,
            rounding=adamw_kernel.ROUND_KAHAN if kahan else adamw_kernel.ROUND_STOCHASTIC,
            comps=[_local(s["kahan_comp"]) for s in states] if kahan else None,
            layouts=[self._layout(p) for p in ps], keys=[step_key(self.seed, self._keys[p], step) for p in ps],
            scales=[_local(s[scale_key]) for s in states] if scale_key else None)
