"""AdamW with its moments in dtypes of their own: fp32 or bf16 master weights, an fp32, bf16 or fp8 first moment,
an fp32 or bf16 second moment (optimizer.exp_avg_dtype / exp_avg_sq_dtype; trainer/optim/states.py).

`LowPrecisionAdamW` is BF16AdamW (trainer/optim/update.py) with the state dtypes free: the same fp32 arithmetic
(`trainer.optim.update.adamw_update`), the same protocol (`grad_scale`, `found_inf`: a non-finite step changes nothing,
the host step counter counts it), and the same hash-keyed random bits, so every bf16 and fp8 value is rounded
stochastically by a function of (seed, step, fqn, the element's global index): identical in every layout that
does not cut an fp8 block, and on resume. fp32 values are stored as computed.

On a GPU the update is the Triton kernel of the other optimizers (trainer/optim/kernel.py, which reads and writes
each state in its own dtype and quantizes an fp8 block per row of a program); on a CPU it runs eagerly, per tensor
in chunks of rows so that its fp32 temporaries stay small. The two draw the same random bits.

Checkpoints hold the state as it is (an fp8 exp_avg as e4m3 plus `exp_avg_scale`); `load_state_dict` keeps the
dtypes it is given (torch's would cast every state tensor to the parameter's dtype) and converts a state saved
with other dtypes to this optimizer's in one log line.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch.distributed.tensor import DTensor

from trainer.optim.update import adamw_update
from trainer.optim.update import (
    BF16AdamW, _local, global_index, random_bits16, round_to_nearest_bf16, step_key, stochastic_round_to_bf16,
)
from trainer.optim.states import (
    DTYPES, SCALE_KEY, StateDtypes, convert_moment, dequantize_blocks, dtype_name, fp8_blocks, quantize_blocks,
    scale_shape,
)

logger = logging.getLogger("trainer.optim")

CHUNK_ELEMENTS = 1 << 22
"""Elements per chunk of the eager update: its ~10 fp32/int64 temporaries stay near 200 MB per chunk."""


def _store(dst: torch.Tensor, value: torch.Tensor, bits: torch.Tensor | None) -> None:
    """fp32 `value` into `dst`: bf16 rounded with `bits` (stochastic; to nearest without), fp32 as is."""
    if dst.dtype == torch.bfloat16:
        dst.copy_(stochastic_round_to_bf16(value, bits) if bits is not None else value)
    else:
        dst.copy_(value)


def _update_rows(p, grad, m, m_scale, v, comp, index, key, lr, bc1, bc2_sqrt, grad_scale, found_inf, *, beta1,
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
    if m_scale is not None:
        q, s = quantize_blocks(m_new, random_bits16(index, key, 1))
        if keep is not None:
            q, s = torch.where(keep, q.view(torch.uint8), m.view(torch.uint8)).view(m.dtype), torch.where(keep, s,
                                                                                                        m_scale)
        m.copy_(q)
        m_scale.copy_(s)
    else:
        _store(m, m_new if keep is None else torch.where(keep, m_new, m_old), random_bits16(index, key, 1))
    _store(v, v_new if keep is None else torch.where(keep, v_new, v_old), random_bits16(index, key, 2))
    if keep is not None:
        delta = torch.where(keep, delta, 0.0)
    if p.dtype == torch.float32:
        p.add_(delta)
    elif comp is None:
        p.copy_(stochastic_round_to_bf16(p32 + delta, random_bits16(index, key, 0)))
    else:  # Kahan (trainer.optim.update._update)
        c_old = comp.float()
        y = delta + c_old
        p_new = round_to_nearest_bf16(p32 + y)
        c = y - (p_new - p32)
        if keep is not None:
            c, p_new = torch.where(keep, c, c_old), torch.where(keep, p_new, p32)
        comp.copy_(c.to(torch.bfloat16))
        p.copy_(p_new.to(torch.bfloat16))


class LowPrecisionAdamW(BF16AdamW):
    """AdamW whose moments have dtypes of their own (see the module docstring).

    dtypes: the resolved StateDtypes; update: 'stochastic' or 'kahan' for bf16 master weights (as BF16AdamW),
    ignored for fp32 ones. triton: the update as one Triton kernel launch per first-moment dtype (a GPU), else
    eagerly (a CPU).
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 dtypes: StateDtypes, update: str = "stochastic", seed: int = 0, triton: bool = False,
                 names=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, update=update, seed=seed,
                         triton=triton, names=names)
        self.dtypes = dtypes
        self.master = DTYPES[dtypes.master]
        self._fp8: dict[torch.Tensor, bool] = {}

    def uses_fp8(self, p: torch.Tensor) -> bool:
        """p's first moment is fp8 (exp_avg_dtype='fp8' and p's shape and layout hold whole blocks)."""
        if p not in self._fp8:
            self._fp8[p] = self.dtypes.exp_avg == "fp8" and fp8_blocks(p)
        return self._fp8[p]

    def exp_avg_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The first moment's dtype for p: fp8 where it holds whole blocks, else bf16 under exp_avg_dtype='fp8'."""
        if self.dtypes.exp_avg == "fp8":
            return DTYPES["fp8"] if self.uses_fp8(p) else torch.bfloat16
        return DTYPES[self.dtypes.exp_avg]

    def _zeros(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def _new_scale(self, p: torch.Tensor) -> torch.Tensor:
        """Block scales for p's fp8 exp_avg, sharded as p (whole blocks: the last dim's shards are 128-multiples)."""
        local = _local(p)
        scales = torch.ones(scale_shape(tuple(local.shape)), dtype=torch.float32, device=local.device)
        if not isinstance(p, DTensor):
            return scales
        shape = torch.Size(scale_shape(tuple(p.shape)))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(scales, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)

    def _state(self, p: torch.Tensor) -> dict:
        assert p.dtype == self.master, f"LowPrecisionAdamW has {self.dtypes.master} master weights, got {p.dtype}"
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._zeros(p, self.exp_avg_dtype(p))
            if self.uses_fp8(p):
                state[SCALE_KEY] = self._new_scale(p)
            state["exp_avg_sq"] = self._zeros(p, DTYPES[self.dtypes.exp_avg_sq])
        if self.master == torch.bfloat16 and self.update == "kahan" and "kahan_comp" not in state:
            state["kahan_comp"] = self._zeros(p, torch.bfloat16)
        state["step"] += 1
        return state

    def _triton_step(self, group: dict, params: list[torch.Tensor], steps: list[int]) -> None:
        """The Triton kernel (trainer/optim/kernel.py): one launch per device, gradient dtype, step and first-moment
        dtype (fp8 blocks and the bf16 first moments of the other tensors: two)."""
        kahan = self.master == torch.bfloat16 and self.update == "kahan"
        launches: dict[tuple, list[torch.Tensor]] = {}
        for p, step in zip(params, steps):
            if _local(p).numel():
                key = (_local(p).device, _local(p.grad).dtype, step, self.state[p]["exp_avg"].dtype)
                launches.setdefault(key, []).append(p)
        for (device, _, step, _), ps in launches.items():
            self._launch(group, ps, device=device, step=step, kahan=kahan,
                         scale_key=SCALE_KEY if SCALE_KEY in self.state[ps[0]] else None)

    def _eager_step(self, group: dict, params: list[torch.Tensor], steps: list[int]) -> None:
        beta1, beta2 = group["betas"]
        kahan = self.master == torch.bfloat16 and self.update == "kahan"
        for p, step in zip(params, steps):
            state = self.state[p]
            local = _local(p)
            if local.numel() == 0:
                continue
            offsets, strides = self._meta(p)
            device = local.device
            tensors = [local, _local(p.grad), _local(state["exp_avg"]),
                       _local(state[SCALE_KEY]) if SCALE_KEY in state else None, _local(state["exp_avg_sq"]),
                       _local(state["kahan_comp"]) if kahan else None]
            scalars = dict(key=torch.tensor(step_key(self.seed, self._keys[p], step), dtype=torch.int64, device=device),
                           lr=torch.tensor(float(group["lr"]), device=device),
                           bc1=torch.tensor(1 - beta1**step, device=device),
                           bc2_sqrt=torch.tensor((1 - beta2**step) ** 0.5, device=device),
                           grad_scale=self.grad_scale if self.grad_scale is None else self.grad_scale.to(device),
                           found_inf=self.found_inf if self.found_inf is None else self.found_inf.to(device))
            rows = max(1, CHUNK_ELEMENTS // max(1, local[0].numel())) if local.dim() else 1
            for r0 in range(0, local.shape[0] if local.dim() else 1, rows):
                chunk = [t if t is None or t.dim() == 0 else t[r0:r0 + rows] for t in tensors]
                start = offsets.clone()
                if local.dim():
                    start[0] += r0
                index = global_index(tuple(chunk[0].shape), start, strides)
                _update_rows(*chunk, index, **scalars, beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"])

    # -- checkpoints -----------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, but every state tensor keeps the dtype it was saved in (torch casts each to its
        parameter's), then converted to this optimizer's dtypes: one log line says what changed."""
        given = {pid: {k: v for k, v in s.items() if isinstance(v, torch.Tensor) and k != "step"}
                 for pid, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        changed: Counter = Counter()
        for pid, p in zip(saved_ids, params):
            if pid not in given:
                continue
            state = self.state[p]
            for key, value in given[pid].items():
                state[key] = value.to(device=_local(p).device) if not isinstance(value, DTensor) else value
            changed.update(self._convert(p, state))
        if changed:
            logger.info("converted the checkpoint's optimizer state to this run's dtypes: %s",
                        ", ".join(f"{what} ({n} tensor{'s' if n > 1 else ''})" for what, n in sorted(changed.items())))

    def _convert(self, p: torch.Tensor, state: dict) -> list[str]:
        """Bring p's loaded state to this optimizer's dtypes (trainer.optim.states.convert_moment); what changed."""
        done = []
        scale = state.pop(SCALE_KEY, None)
        m = state["exp_avg"]
        if m.dtype != self.exp_avg_dtype(p) or (scale is None) == self.uses_fp8(p):
            state["exp_avg"] = self._zeros(p, self.exp_avg_dtype(p))
            if self.uses_fp8(p):
                state[SCALE_KEY] = self._new_scale(p)
            convert_moment(state["exp_avg"], state.get(SCALE_KEY), m, scale)
            done.append(f"exp_avg {dtype_name(m, scale)} -> {dtype_name(state['exp_avg'])}")
        elif scale is not None:
            state[SCALE_KEY] = scale
        v = state["exp_avg_sq"]
        if v.dtype != DTYPES[self.dtypes.exp_avg_sq]:
            state["exp_avg_sq"] = v.to(DTYPES[self.dtypes.exp_avg_sq])
            done.append(f"exp_avg_sq {dtype_name(v)} -> {self.dtypes.exp_avg_sq}")
        return done
