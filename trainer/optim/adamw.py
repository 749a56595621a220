"""One AdamW over the local shards of its parameters, by its state dtypes and its rounding.

    dtypes          master weights fp32 or bf16, exp_avg fp32, bf16 or fp8, exp_avg_sq fp32 or bf16 (StateDtypes,
                    trainer/optim/states.py: optimizer.exp_avg_dtype / exp_avg_sq_dtype, distributed.master_dtype)
    rounding        how bf16 master weights take an update: "nearest" (plain AdamW), "stochastic" or "kahan"
                    (optimizer.bf16_update; trainer/optim/update.py says why)
    implementation  which code runs the update (optimizer.implementation, resolved by trainer.validate):
        "triton"    one launch of the Triton kernel per device and dtype (trainer/optim/kernel.py): the GPU path
        "eager"     the same update in torch, per tensor (trainer/optim/update.py): its CPU reference
        "fused"     torch's fused AdamW kernel (torch._fused_adamw_) over the local shards: plain AdamW's reference

A state is one of two kinds, and `implementation` must run it (`is_rounded`; a conflict is a config error):

- plain AdamW: every moment in the master dtype, and fp32 master weights or bf16 ones rounded to nearest. The state
  is torch's fused AdamW's ("step" a 0-dim fp32 device tensor, which a skipped step does not count; the moments
  shaped, sharded and typed as their parameters), so checkpoints move between it and torch.optim.AdamW (fused or
  foreach, the other references: trainer/optim/build.py). "fused" or "triton".
- rounded: bf16 master weights rounded stochastically or with Kahan compensation, or moments in dtypes of their
  own. Every bf16 and fp8 value is rounded stochastically by a function of (seed, step, fqn, the element's global
  index), so every layout that does not cut an fp8 block rounds as one process does, and a resume as the
  uninterrupted run; the host counts the steps (a CPU tensor: the random bits must not wait on the device; a
  skipped step counts). An fp8 exp_avg is saved as e4m3 plus `exp_avg_scale`. "triton" or "eager".

Either follows torch's fused protocol: set `grad_scale` (gradients are divided by it) and `found_inf` (a nonzero
value skips the step on the device, leaving weights and state unchanged) before `step()`. `load_state_dict` keeps
the dtypes it is given (torch's would cast every state tensor to its parameter's) and converts a state saved with
other dtypes to this optimizer's, in one log line.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from trainer.distributed import Layout, plain_tensor
from trainer.optim.states import (
    DTYPES, SCALE_KEY, StateDtypes, convert_moment, dtype_name, fp8_blocks, scale_shape,
)
from trainer.optim.update import CHUNK_ELEMENTS, global_index, param_key, step_key, update_rows

logger = logging.getLogger("trainer.optim")

_local = functools.partial(plain_tensor, local=True)  # the plain tensor an optimizer updates in place

Rounding = Literal["nearest", "stochastic", "kahan"]
Implementation = Literal["triton", "eager", "fused"]
RUNS = {False: ("fused", "triton"), True: ("eager", "triton")}
"""The implementations of a plain (False) and a rounded (True) state."""


@functools.cache
def _torch_fused_group() -> dict[str, Any]:
    """The param-group settings torch.optim.AdamW(fused=True) adds to AdamW's four (amsgrad, fused, ...), in its
    order."""
    defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True).defaults
    return {k: v for k, v in defaults.items() if k not in ("lr", "betas", "eps", "weight_decay")}


def is_rounded(dtypes: StateDtypes, rounding: Rounding) -> bool:
    """Whether AdamW rounds its state itself (see the module docstring): bf16 master weights not rounded to nearest,
    or moments outside the master dtype. torch's kernels cannot run such a state."""
    return (dtypes.master == "bf16" and rounding != "nearest") or not dtypes.in_master_dtype


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) over the local shards of its parameters; see the module
    docstring for `dtypes`, `rounding` and `implementation`."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 implementation: Implementation, dtypes: StateDtypes | None = None, rounding: Rounding = "nearest",
                 seed: int = 0, names: Sequence[str] | None = None):
        """dtypes: None keeps every state in its parameter's dtype (plain AdamW on the parameters as they are).
        seed, names: the rounding's random bits (`names`: each parameter's fqn in the order of `params`, the model's
        without compile/AC wrapper names; None: the position, "0", "1", ...)."""
        params = list(params)
        flat = [p for entry in params for p in (entry["params"] if isinstance(entry, dict) else [entry])]
        self.dtypes = dtypes or StateDtypes.of(flat)
        self.rounding, self.implementation, self.seed = rounding, implementation, seed
        self.rounded = is_rounded(self.dtypes, rounding)
        # A plain state's groups are torch's fused AdamW's too, so its state dict is that optimizer's (state.json).
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      **({} if self.rounded else _torch_fused_group())))
        self.kahan = self.dtypes.master == "bf16" and rounding == "kahan"
        assert implementation in RUNS[self.rounded], (implementation, self.dtypes, rounding)
        assert not (self.dtypes.master == "bf16" and rounding == "nearest" and self.rounded), (
            "bf16 master weights rounded to nearest keep their moments in bf16")
        names = list(names) if names is not None else [str(i) for i in range(len(flat))]
        assert len(names) == len(flat), (len(names), len(flat))
        self._keys = {p: param_key(name) for p, name in zip(flat, names)}
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        self._layouts: dict[torch.Tensor, Layout] = {}
        self._index_meta: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._fp8: dict[torch.Tensor, bool] = {}

    def describe(self) -> str:
        """What this AdamW keeps, for the startup line: 'bf16 master weights, stochastic rounding'."""
        master = f"{self.dtypes.master} master weights"
        if not self.dtypes.in_master_dtype:
            return f"{master}, moments in dtypes of their own"
        if self.dtypes.master == "bf16":
            return f"{master}, {'round to nearest' if self.rounding == 'nearest' else self.rounding + ' rounding'}"
        return master

    # -- the state ------------------------------------------------------------------------------------------

    def uses_fp8(self, p: torch.Tensor) -> bool:
        """p's first moment is fp8 (exp_avg_dtype='fp8' and p's shape and layout hold whole blocks)."""
        if p not in self._fp8:
            self._fp8[p] = self.dtypes.exp_avg == "fp8" and fp8_blocks(p)
        return self._fp8[p]

    def exp_avg_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The first moment's dtype for p: fp8 where it holds whole blocks, else bf16 under exp_avg_dtype='fp8'."""
        if not self.rounded:
            return p.dtype
        if self.dtypes.exp_avg == "fp8":
            return DTYPES["fp8"] if self.uses_fp8(p) else torch.bfloat16
        return DTYPES[self.dtypes.exp_avg]

    def exp_avg_sq_dtype(self, p: torch.Tensor) -> torch.dtype:
        return DTYPES[self.dtypes.exp_avg_sq] if self.rounded else p.dtype

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
        """p's state, made at its first step: torch's fused AdamW's (plain), or ours with the host's step counting
        this one (rounded)."""
        state = self.state[p]
        if not self.rounded:
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                state["exp_avg"] = self._zeros(p, p.dtype)
                state["exp_avg_sq"] = self._zeros(p, p.dtype)
            return state
        assert p.dtype == DTYPES[self.dtypes.master], f"AdamW has {self.dtypes.master} master weights, got {p.dtype}"
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._zeros(p, self.exp_avg_dtype(p))
            if self.uses_fp8(p):
                state[SCALE_KEY] = self._new_scale(p)
            state["exp_avg_sq"] = self._zeros(p, self.exp_avg_sq_dtype(p))
        if self.kahan and "kahan_comp" not in state:
            state["kahan_comp"] = self._zeros(p, torch.bfloat16)
        state["step"] += 1
        return state

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

    # -- the step ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, f"{type(self).__name__} takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not self.rounded:
                self._plain_step(group, params)
                continue
            steps = [int(self._state(p)["step"].item()) for p in params]  # CPU tensors: no device sync
            (self._triton_step if self.implementation == "triton" else self._eager_step)(group, params, steps)
        return None

    def _plain_step(self, group: dict, params: list[torch.Tensor]) -> None:
        """Every local tensor of a device and dtype in one call of torch's fused kernel or ours, the device's steps
        counting this one (a skipped step is taken back, as torch's fused AdamW does)."""
        lists: dict[tuple, tuple[list, list, list, list, list]] = {}
        for p in params:
            state = self._state(p)
            local, grad = _local(p), _local(p.grad)
            entry = lists.setdefault((local.device, local.dtype, grad.dtype), ([], [], [], [], []))
            for out, t in zip(entry, (local, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                                      state["step"])):
                out.append(t)
        beta1, beta2 = group["betas"]
        for (device, _, _), (ps, grads, exp_avgs, exp_avg_sqs, steps) in lists.items():
            scale = None if self.grad_scale is None else self.grad_scale.to(device)
            inf = None if self.found_inf is None else self.found_inf.to(device)
            torch._foreach_add_(steps, 1)
            if self.implementation == "fused":
                torch._fused_adamw_(
                    ps, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
                    beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                    grad_scale=scale, found_inf=inf,
                )
            else:
                import trainer.optim.kernel as kernel  # only where it runs: Triton comes with torch's CUDA builds

                kernel.adamw_step(ps, grads, exp_avgs, exp_avg_sqs, lr=group["lr"], beta1=beta1, beta2=beta2,
                                  eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=scale,
                                  found_inf=inf, steps=steps)
            if inf is not None:  # a skipped step does not count (as in torch's fused AdamW)
                torch._foreach_sub_(steps, [inf] * len(steps))

    def _triton_step(self, group: dict, params: list[torch.Tensor], steps: list[int]) -> None:
        """The Triton kernel: one launch per device, gradient dtype, step and first-moment dtype (fp8 blocks and the
        bf16 first moments of the other tensors: two)."""
        launches: dict[tuple, list[torch.Tensor]] = {}
        for p, step in zip(params, steps):
            if _local(p).numel():
                key = (_local(p).device, _local(p.grad).dtype, step, self.state[p]["exp_avg"].dtype)
                launches.setdefault(key, []).append(p)
        for (device, _, step, _), ps in launches.items():
            self._launch(group, ps, device=device, step=step)

    def _launch(self, group: dict, ps: list[torch.Tensor], *, device: torch.device, step: int) -> None:
        """One launch of the Triton kernel over these parameters, all on `device` at `step`."""
        import trainer.optim.kernel as kernel  # only where it runs: Triton comes with torch's CUDA builds

        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in ps]
        fp8 = SCALE_KEY in states[0]
        kernel.adamw_step(
            [_local(p) for p in ps], [_local(p.grad) for p in ps], [_local(s["exp_avg"]) for s in states],
            [_local(s["exp_avg_sq"]) for s in states], lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"],
            grad_scale=None if self.grad_scale is None else self.grad_scale.to(device),
            found_inf=None if self.found_inf is None else self.found_inf.to(device), step=step,
            rounding=kernel.ROUND_KAHAN if self.kahan else kernel.ROUND_STOCHASTIC,
            comps=[_local(s["kahan_comp"]) for s in states] if self.kahan else None,
            layouts=[self._layout(p) for p in ps], keys=[step_key(self.seed, self._keys[p], step) for p in ps],
            scales=[_local(s[SCALE_KEY]) for s in states] if fp8 else None)

    def _eager_step(self, group: dict, params: list[torch.Tensor], steps: list[int]) -> None:
        """trainer.optim.update.update_rows per tensor, in chunks of rows so that its fp32 temporaries stay small."""
        beta1, beta2 = group["betas"]
        for p, step in zip(params, steps):
            state, local = self.state[p], _local(p)
            if local.numel() == 0:
                continue
            offsets, strides = self._meta(p)
            device = local.device
            tensors = [local, _local(p.grad), _local(state["exp_avg"]),
                       _local(state[SCALE_KEY]) if SCALE_KEY in state else None, _local(state["exp_avg_sq"]),
                       _local(state["kahan_comp"]) if self.kahan else None]
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
                update_rows(*chunk, index, **scalars, beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"])

    # -- checkpoints -----------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, but every state tensor keeps the dtype it was saved in (torch casts each to its
        parameter's), then converted to this optimizer's dtypes: one log line says what changed. The step is
        where this optimizer counts it (plain: an fp32 tensor on the parameter's device; rounded: the host)."""
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
            if "step" in state:
                state["step"] = state["step"].to(device="cpu" if self.rounded else _local(p).device, dtype=torch.float32)
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
        if v.dtype != self.exp_avg_sq_dtype(p):
            state["exp_avg_sq"] = v.to(self.exp_avg_sq_dtype(p))
            done.append(f"exp_avg_sq {dtype_name(v)} -> {dtype_name(state['exp_avg_sq'])}")
        return done
