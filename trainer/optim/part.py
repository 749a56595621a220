"""The optimizer's part of a checkpoint (trainer/checkpoint/parts.py): AdamW's moments and steps by parameter fqn,
and a resume with moments saved in other dtypes than this run's (optimizer.exp_avg_dtype / exp_avg_sq_dtype,
distributed.master_dtype, optimizer.bf16_update='kahan'), converted here and nowhere else.

DCP loads a tensor into this run's tensor by `copy_`, which converts fp32 <-> bf16 but would read an fp8 exp_avg
without its block scales. So before the load, every moment whose saved dtype (or fp8-ness) differs from this run's
is replaced in the state dict by a staging tensor in the saved dtype, sharded as this run's (`stage`): DCP reshards
into it as into any tensor; the block scales of a saved fp8 exp_avg are staged whole (the parameter's elements / 128
fp32 values), so any shard can dequantize. After the load `convert` writes each into this run's tensor
(trainer.optim.states.convert_moment: through fp32, to nearest), in one log line, before the state reaches the
optimizer (ours or torch's).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from trainer.distributed import plain_tensor
from trainer.optim.states import SCALE_KEY, convert_moment, dtype_name
from trainer.tensor_values import FINITE, TensorRule

logger = logging.getLogger("trainer.optim")


class OptimizerPart:
    """The optimizer's state by clean parameter fqn (DCP's `get_optimizer_state_dict`), its tensors plain (the
    moments of an fp8 all-gather weight without the wrapper). The config is the source of truth for the
    hyperparameters (a cooldown relaunch may change them): the checkpoint supplies the moments and step counts."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self._staged: dict[str, dict] = {}

    def state_dict(self) -> dict[str, Any]:
        sd = get_optimizer_state_dict(self.model, self.optimizer)
        sd["state"] = {fqn: {k: plain_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                       for fqn, s in sd["state"].items()}
        return sd

    def reconcile(self, sd: dict[str, Any], saved: dict[str, TensorStorageMetadata]) -> str | None:
        """Moments saved in other dtypes load into staging tensors of those dtypes; Kahan buffers a checkpoint lacks
        (optimizer.bf16_update was not 'kahan') start at zero."""
        self._staged, fresh_kahan = stage(sd["state"], {k[len("state."):]: md for k, md in saved.items()
                                                       if k.startswith("state.")})
        return ("checkpoint has no Kahan compensation buffers (optimizer.bf16_update was not 'kahan'): starting them "
                "at zero") if fresh_kahan else None

    def tensor_rule(self, key: str, *, step: int) -> TensorRule:
        """What each loaded state tensor must hold (`key`: "state.{fqn}.{name}"): checked before the conversions
        below or the optimizer see it (trainer/tensor_values.py)."""
        name = key.rpartition(".")[2]
        if name == "step":  # bias correction divides by 1 - beta ** step; skipped steps count in ours, not in torch's
            return TensorRule(low=0, high=step, integral=True, why="AdamW's step count, at most the checkpoint's")
        if name == "exp_avg_sq":
            return TensorRule(low=0, why="AdamW's second moment, a mean of squares")
        if name == SCALE_KEY:
            return TensorRule(low=0, low_open=True, why="the fp8 first moment's block scales")
        return FINITE

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        staged, self._staged = self._staged, {}
        if converted := staged and convert(sd["state"], staged):
            logger.info("converted the checkpoint's AdamW moments to this run's dtypes (optimizer.exp_avg_dtype, "
                        "exp_avg_sq_dtype, distributed.master_dtype): %s", converted)
        config_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, sd)
        self._keep_config_hyperparameters(config_groups)

    def _keep_config_hyperparameters(self, config_groups: list[dict]) -> None:
        changed = set()
        for group, config in zip(self.optimizer.param_groups, config_groups):
            for key, value in config.items():
                saved = group.get(key)
                if isinstance(value, tuple) and isinstance(saved, list):
                    saved = tuple(saved)  # JSON has no tuples (Adam's betas)
                if key != "lr" and saved != value:
                    changed.add(f"{key} {saved} -> {value}")
                group[key] = value
        if changed:
            logger.warning("optimizer settings differ from the checkpoint; using this run's: %s",
                           ", ".join(sorted(changed)))


MOMENTS = ("exp_avg", "exp_avg_sq")


def stage(state: dict[str, dict[str, Any]], entries: dict[str, Any]) -> tuple[dict[str, dict], bool]:
    """Stage, in the optimizer's state about to be loaded (`state`: fqn -> entries), the moments the checkpoint
    holds in other dtypes (`entries`: its DCP entries of the optimizer's state, by "{fqn}.{name}"). Returns (this run's tensors
    of each staged moment, fqn -> {name: (tensor, scale)}), and whether Kahan buffers start at zero (a checkpoint
    without them)."""
    runs: dict[str, dict] = {}
    fresh_kahan = False
    for fqn, s in state.items():
        prefix = f"{fqn}."
        if "kahan_comp" in s and prefix + "kahan_comp" not in entries:
            del s["kahan_comp"]  # AdamW makes it at zero at the next step
            fresh_kahan = True
        for name in MOMENTS:
            t, md = s.get(name), entries.get(prefix + name)
            if t is None or md is None:
                continue  # a missing entry is DCP's error, as before
            run_scale = s.get(SCALE_KEY) if name == "exp_avg" else None
            saved_scale = entries.get(prefix + SCALE_KEY) if name == "exp_avg" else None
            if md.properties.dtype == t.dtype and (run_scale is None) == (saved_scale is None):
                continue
            runs.setdefault(fqn, {})[name] = (t, run_scale)
            s[name] = torch.empty_like(t, dtype=md.properties.dtype)  # a DTensor stays sharded as this run's
            if name == "exp_avg":
                s.pop(SCALE_KEY, None)
                if saved_scale is not None:
                    s[SCALE_KEY] = torch.empty(tuple(saved_scale.size), dtype=saved_scale.properties.dtype,
                                               device=plain_tensor(t, local=True).device)
    return runs, fresh_kahan


def convert(state: dict[str, dict[str, Any]], runs: dict[str, dict]) -> str:
    """After the load: each staged moment converted into this run's tensor, put back in `state`. What was
    converted, for the log ('' when nothing)."""
    counts: Counter = Counter()
    for fqn, run in runs.items():
        s = state[fqn]
        for name, (target, target_scale) in run.items():
            saved = s[name]
            saved_scale = s.pop(SCALE_KEY, None) if name == "exp_avg" else None
            convert_moment(target, target_scale, saved, saved_scale)
            counts[f"{name} {dtype_name(saved, saved_scale)} -> {dtype_name(target, target_scale)}"] += 1
            s[name] = target
            if target_scale is not None:
                s[SCALE_KEY] = target_scale
    return ", ".join(f"{what} ({n} tensor{'s' if n > 1 else ''})" for what, n in sorted(counts.items()))
