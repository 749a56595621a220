"""The MoE step hook: expert-bias balancing after each optimizer step, and the per-layer MoE metrics.

Every MoE layer (trainer/models/moe.py) counts, since the last optimizer step, the tokens
routed to each expert, the dropped assignments, its aux loss and its forward calls, in one
buffer (`MoE.stats`). `MoEBalancer` reads them all after every step: it sums them over the
data-parallel ranks, moves the aux-loss-free expert biases from the global loads, and keeps
interval totals that the log line reports. Every reported number is a ratio of those
counters, so activation checkpointing (which runs a forward twice) changes none of them.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from trainer.hooks import StepHook
from trainer.models.layers import clean_fqn
from trainer.models.moe import STAT_AUX, STAT_CALLS, STAT_DROPPED, MoE


class MoEBalancer(StepHook):
    """The MoE step hook (trainer/hooks.py). After each optimizer step it sums every MoE layer's
    counters over `stage_group`, every rank of this pipeline stage (data-parallel ranks, and tp
    ranks, which route slices of the same sequences; one all-reduce, no host sync), moves the expert biases
    (masked by `found_inf`: a skipped step moves none) and keeps interval totals; at log steps it
    reports per-layer load imbalance, aux loss and dropped fraction, and the total aux loss.

    Layers are named by their block index, which is global: under pipeline parallelism each pp
    rank holds some layers (maybe none) and the log gathers them over `pp_group`. Every rank of a
    job with an MoE model must hold one, since `after_optimizer_step` and `on_log` are collective.
    """

    def __init__(self, model: nn.Module, *, bias_update_rate: float, stage_group: dist.ProcessGroup | None = None,
                 pp_group: dist.ProcessGroup | None = None):
        self.layers: list[tuple[str, MoE]] = [
            (clean_fqn(fqn).split(".")[1], m) for fqn, m in model.named_modules() if isinstance(m, MoE)
        ]
        self.rate = bias_update_rate
        self.stage_group, self.pp_group = stage_group, pp_group
        self.interval: torch.Tensor | None = None

    @property
    def modules(self) -> list[MoE]:
        return [m for _, m in self.layers]

    @torch.no_grad()
    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        if not self.layers:
            return
        stats = torch.stack([m.stats for _, m in self.layers])
        if self.stage_group is not None and dist.get_world_size(self.stage_group) > 1:
            dist.all_reduce(stats, group=self.stage_group)
        keep = (~found_inf).to(torch.float32)
        for (_, m), s in zip(self.layers, stats):
            if self.rate > 0:
                m.router.update_bias(s[: m.n_experts], self.rate, keep=keep)
            m.stats.zero_()
        self.interval = stats if self.interval is None else self.interval + stats

    def on_log(self, step: int) -> dict[str, float]:
        """Since the last log: per layer and overall load imbalance (max/mean tokens per expert), aux
        loss (unscaled per layer; `aux_loss` = sum over layers of aux_loss_coef x layer aux loss, the
        term the objective adds), fraction of assignments dropped. note: a host sync."""
        layers = self._layer_metrics()
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            parts: list[object] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(parts, layers, group=self.pp_group)
            layers = {k: v for part in parts for k, v in part.items()}
        if not layers:
            return {}
        out: dict[str, float] = {"aux_loss": sum(m["aux_loss_term"] for m in layers.values())}
        for name in sorted(layers, key=int):
            for key in ("imbalance", "aux_loss", "dropped_fraction"):
                out[f"moe/layer{name}/{key}"] = layers[name][key]
        n = len(layers)
        out["moe/imbalance_max"] = max(m["imbalance"] for m in layers.values())
        out["moe/imbalance_mean"] = sum(m["imbalance"] for m in layers.values()) / n
        out["moe/dropped_fraction"] = sum(m["dropped_fraction"] for m in layers.values()) / n
        return out

    def _layer_metrics(self) -> dict[str, dict[str, float]]:
        """This rank's layers since the last call: {block index: metrics}; resets the interval."""
        if self.interval is None:
            return {}
        rows = self.interval.tolist()
        self.interval = None
        out = {}
        for (name, m), row in zip(self.layers, rows):
            e = m.n_experts
            load, extra = row[:e], row[e:]
            total = sum(load)
            aux = extra[STAT_AUX] / extra[STAT_CALLS] if extra[STAT_CALLS] else 0.0
            out[name] = {"imbalance": max(load) / (total / e) if total else 0.0, "aux_loss": aux,
                         "aux_loss_term": m.aux_loss_coef * aux,
                         "dropped_fraction": extra[STAT_DROPPED] / total if total else 0.0}
        return out
