"""Delayed scaling's once-per-step work: reduce the step's amaxes over the ranks, roll the histories, new scales.

Transformer Engine / NeMo's recipe (`DelayedScaling(amax_history_len, amax_compute_algo, margin)` with
`reduce_amax=True`), for our `Float8TensorwiseLinear`s: during an optimizer step every converted Linear records,
per operand (input, weight, output gradient), the largest |value| it saw (`amax` buffer; a max over the
microbatches and activation-checkpoint recomputes). After the optimizer step this hook

1. stacks every layer's `amax` and all-reduces them (MAX) in ONE collective over the ranks that compute the same
   layers on other data: the data-parallel x context-parallel ranks of this pipeline stage (`dp_cp` mesh; FP8 runs
   have no tensor parallelism). After it every rank holds the same histories and scales;
2. rolls each history (newest first, `amax_history_len` long) unless the step was skipped (`found_inf`: a
   non-finite step records nothing, else one inf would poison `amax_history_len` steps);
3. computes the next step's scales: `fp8_max / amax / 2**margin`, amax = the history's max (`"max"`) or newest
   value (`"most_recent"`); a history with no nonzero amax keeps the scale it had (1 at the start, TE's rule);
4. zeroes the step amaxes, and after the first step switches the layers to the scales (before it they scale
   each tensor by its own amax: the first step has no history).

Everything stays on the device (no host sync). The histories and scales are this hook's `state_dict`, saved in
checkpoints as `float8_scaling.{fqn}.{amax_history,scale}` (trainer.checkpoint), not in the model's state_dict.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.hooks import StepHook
from trainer.models.layers import clean_fqn
from trainer.parallel.float8.tensorwise import E4M3, OPERANDS, Float8TensorwiseLinear
from trainer.tensor_values import TensorRule

logger = logging.getLogger(__name__)

EPS = 1e-12  # torchao.float8.float8_utils.EPS: the scale formula's floor on amax
# The largest amax a checkpoint's history may hold: the mirror of EPS. A Linear's input, weight or output gradient
# whose |value| passes 1e12 is a run that diverged; and one crafted amax of 1e30 would scale that operand by 448 /
# 1e30 for amax_history_len steps, flushing every ordinary value to zero in FP8 without a word.
AMAX_CEILING = 1e12


def delayed_modules(model: nn.Module) -> dict[str, Float8TensorwiseLinear]:
    """Every Linear of `model` that runs delayed scaling, by clean fqn."""
    return {clean_fqn(fqn): m for fqn, m in model.named_modules()
            if isinstance(m, Float8TensorwiseLinear) and m.cast.delayed}


def delayed_scales(history: torch.Tensor, fp8_max: torch.Tensor, previous: torch.Tensor, *, algo: str,
                   margin: int) -> torch.Tensor:
    """Scales from amax histories (`[..., history_len]`, newest first): fp8_max / amax / 2**margin, with torchao's
    formula (float64, amax clamped to 1e-12, then fp32); where the amax is 0 the `previous` scale stays."""
    amax = history.amax(dim=-1) if algo == "max" else history[..., 0]
    scale = (fp8_max.double() / amax.double().clamp(min=EPS) / 2.0 ** margin).float()
    return torch.where(amax > 0, scale, previous)


class DelayedScaling(StepHook):
    """The step hook of float8.scaling='delayed' (see the module docstring); also the histories' checkpoint state."""

    checkpoint_key = "float8_scaling"  # its entry in trainer.checkpoint.CheckpointState

    def __init__(self, model: nn.Module, *, history_len: int, algo: str, margin: int,
                 group: dist.ProcessGroup | None):
        self.modules = delayed_modules(model)
        self.algo, self.margin, self.group = algo, margin, group
        mods = list(self.modules.values())
        device = mods[0].amax.device if mods else torch.device("cpu")
        self.history = torch.zeros(len(mods), len(OPERANDS), history_len, dtype=torch.float32, device=device)
        grad_max = [torch.finfo(m.cast.grad_dtype).max for m in mods]
        e4m3_max = torch.finfo(E4M3).max
        self.fp8_max = torch.tensor([[e4m3_max, e4m3_max, g] for g in grad_max], dtype=torch.float32,
                                    device=device).reshape(len(mods), len(OPERANDS))
        # The buffers were made on the meta device and materialized uninitialized (trainer.parallel.build).
        for m in mods:
            m.amax.zero_()
            m.scale.fill_(1.0)
        self.started = False

    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        if not self.modules:
            return
        mods = list(self.modules.values())
        amax = torch.stack([m.amax for m in mods])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)  # NeMo's reduce_amax: one collective
        rolled = torch.cat([amax.unsqueeze(-1), self.history[..., :-1]], dim=-1)
        self.history.copy_(torch.where(found_inf.to(amax.device), self.history, rolled))
        self._refresh_scales(mods)
        torch._foreach_zero_([m.amax for m in mods])
        if not self.started:
            self._start(mods)

    def _refresh_scales(self, mods: list[Float8TensorwiseLinear]) -> None:
        previous = torch.stack([m.scale for m in mods])
        scales = delayed_scales(self.history, self.fp8_max, previous, algo=self.algo, margin=self.margin)
        torch._foreach_copy_([m.scale for m in mods], list(scales.unbind(0)))

    def _start(self, mods: list[Float8TensorwiseLinear]) -> None:
        # A Python switch: under torch.compile the blocks recompile once, for the scaled casts (step 2).
        for m in mods:
            m.use_history()
        self.started = True

    # -- checkpoint state: trainer.checkpoint.CheckpointState's "float8_scaling" entry ----------------------------

    def state_dict(self) -> dict[str, Any]:
        """{fqn: {"amax_history": [3, history_len], "scale": [3]}}: views of the live tensors (DCP loads in place).
        The same on every rank of a stage after the reduce, so any layout can load them."""
        return {fqn: {"amax_history": self.history[i], "scale": m.scale}
                for i, (fqn, m) in enumerate(self.modules.items())}

    def tensor_rule(self, key: str, *, step: int) -> TensorRule:
        """What a checkpoint's `{fqn}.amax_history` and `{fqn}.scale` may hold: fp32 as saved, amaxes in
        [0, AMAX_CEILING], scales in the range the formula gives from them with this run's margin (1 before any)."""
        if key.endswith(".amax_history"):
            return TensorRule(low=0, high=AMAX_CEILING, dtypes=(torch.float32,),
                              why=f"an amax above {AMAX_CEILING:g} would flush the operand to zero in FP8 for "
                                  "float8.amax_history_len steps")
        # fp8_max / amax / 2**margin for an amax in [EPS, AMAX_CEILING]; e5m2's fp8_max (gradients) is the larger.
        low = math.ldexp(torch.finfo(E4M3).max / AMAX_CEILING, -self.margin)  # 2.0 ** margin could overflow
        return TensorRule(low=low, low_open=True, high=torch.finfo(torch.float8_e5m2).max / EPS,
                          dtypes=(torch.float32,), why=f"fp8_max / amax / 2**float8.margin for an amax in "
                                                       f"[{EPS:g}, {AMAX_CEILING:g}]")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """After DCP loaded the tensors in place: the casts use the loaded scales from the first resumed step."""
        assert set(sd) == set(self.modules), (sorted(set(sd) ^ set(self.modules)))[:3]
        for i, (fqn, m) in enumerate(self.modules.items()):
            self.history[i].copy_(sd[fqn]["amax_history"])
            m.scale.copy_(sd[fqn]["scale"])
        self._start(list(self.modules.values()))

    def describe(self) -> str:
        return (f"delayed scaling: {len(self.modules)} Linear layers, amax histories of {self.history.shape[-1]} "
                f"steps ({self.algo}, margin {self.margin}), reduced over {_group_size(self.group)} rank(s) once "
                "per step; step 1 scales each tensor by its own amax (no history yet)")


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
