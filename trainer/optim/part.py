"""Resuming AdamW's moments saved in other dtypes than this run's (optimizer.exp_avg_dtype / exp_avg_sq_dtype,
distributed.master_dtype, optimizer.bf16_update='kahan').

DCP loads a tensor into this run's tensor by `copy_`, which converts fp32 <-> bf16 but would read an fp8 exp_avg
without its block scales. So before the load, every moment whose saved dtype (or fp8-ness) differs from this run's
is replaced in the state dict by a staging tensor in the saved dtype, sharded as this run's (`stage`): DCP reshards
into it as into any tensor; the block scales of a saved fp8 exp_avg are staged whole (the parameter's elements / 128
fp32 values), so any shard can dequantize. After the load `convert` writes each into this run's tensor
(trainer.optim.states.convert_moment: through fp32, to nearest) and the manager logs one line of what it converted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from trainer.distributed import plain_tensor
from trainer.optim.states import SCALE_KEY, convert_moment, dtype_name

MOMENTS = ("exp_avg", "exp_avg_sq")


def stage(state: dict[str, dict[str, Any]], entries: dict[str, Any]) -> tuple[dict[str, dict], bool]:
    """Stage, in the optimizer part of a state dict about to be loaded (`state`: fqn -> entries), the moments the
    checkpoint (`entries`: its .metadata's state_dict_metadata) holds in other dtypes. Returns (this run's tensors
    of each staged moment, fqn -> {name: (tensor, scale)}), and whether Kahan buffers start at zero (a checkpoint
    without them)."""
    runs: dict[str, dict] = {}
    fresh_kahan = False
    for fqn, s in state.items():
        prefix = f"optimizer.state.{fqn}."
        if "kahan_comp" in s and prefix + "kahan_comp" not in entries:
            del s["kahan_comp"]  # BF16AdamW recreates it at zero at the next step
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
