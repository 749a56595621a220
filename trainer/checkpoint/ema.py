"""train.ema_decay: an exponential moving average of the weights, kept beside the master weights and checkpointed.

After every optimizer step `ema = decay * ema + (1 - decay) * w` (one `lerp` per tensor: the same average), in fp32,
on this rank's shards of the parameters: under FSDP2 the average of a DTensor parameter is a DTensor of the same
mesh and placements, so nothing is gathered and it costs 4 bytes per parameter of the rank's shard. A skipped step
(non-finite, fp16 overflow) leaves it as it was, masked on the device (the step never waits on the GPU).

It is saved as the checkpoint part `ema` (`ema.{fqn}`, global tensors through DCP: a resume at another layout
reshards it like the weights); `EMAPart` says in one line when a checkpoint has none (the average then starts from
the resumed weights) or when this run leaves a checkpoint's unused. A new run's average starts from the weights of
its first step (checkpoint.initial_load_path's, where it loads some). `swapped_in()` puts the average into the
parameters for an evaluation (val_loss_ema) and restores the trained weights bit for bit. Offline, a checkpoint's
average is what `--weights=ema` exports or generates with (trainer/checkpoint/offline.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.distributed import plain_tensor
from trainer.hooks import StepHook
from trainer.models.layers import clean_fqn

logger = logging.getLogger("trainer.checkpoint")

EMA_PART = "ema"
"""The checkpoint part (and DCP key prefix) of the average."""


class EMAWeights(StepHook):
    """The average of `model`'s parameters, updated after each optimizer step (a step hook: trainer/hooks.py)."""

    def __init__(self, model: nn.Module, *, decay: float):
        assert 0 < decay < 1, decay  # trainer.validate checked train.ema_decay
        self.model, self.decay = model, decay
        # The average starts from the weights of the first step (after any load: a resume without an average,
        # checkpoint.initial_load_path's weights); a checkpoint's average, once loaded, is kept instead.
        self.restart = True
        # Recomputes what derives from the weights (fp8 all-gather's precomputed scales: the trainer wires the hooks'
        # `refresh`), after each swap: an evaluation of the average casts it with its own scales, not the trained ones.
        self.after_swap: list[Callable[[], None]] = []
        self.ema: dict[str, torch.Tensor] = {}
        by_param: dict[int, torch.Tensor] = {}
        for name, p in self._params():
            # A tied head shares the embedding's average (one tensor under both names, updated once).
            if id(p) not in by_param:
                by_param[id(p)] = plain_tensor(p.detach()).float().clone()
            self.ema[name] = by_param[id(p)]
        self.nbytes = sum(plain_tensor(t, local=True).numel() * 4 for t in by_param.values())
        logger.info("EMA weights: train.ema_decay=%g, fp32 on this rank's shards of %d tensors, %.1f MiB (4 B per "
                    "parameter of the shard)", decay, len(by_param), self.nbytes / 2**20)

    @classmethod
    def maybe(cls, model: nn.Module, *, decay: float) -> EMAWeights | None:
        """The average, or None with train.ema_decay=0."""
        return cls(model, decay=decay) if decay > 0 else None

    def _params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(clean fqn, parameter) of every parameter, a tied one under each of its names."""
        for name, p in self.model.named_parameters(remove_duplicate=False):
            yield clean_fqn(name), p

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the averages' local shards, the parameters' local shards), each tensor once."""
        seen, emas, weights = set(), [], []
        for name, p in self._params():
            if id(p) in seen:
                continue
            seen.add(id(p))
            emas.append(plain_tensor(self.ema[name], local=True))
            weights.append(plain_tensor(p.detach(), local=True))
        return emas, weights

    @torch.no_grad()
    def copy_weights(self) -> None:
        """The average := the weights (a resume from a checkpoint without an average)."""
        for ema, w in zip(*self._pairs()):
            ema.copy_(w)

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        if self.restart:  # before this run's first step: whatever was loaded is in the weights by now
            self.copy_weights()
            self.restart = False
        return contextlib.nullcontext()

    @torch.no_grad()
    def after_optimizer_step(self, step: int, found_inf: torch.Tensor | None) -> None:
        emas, weights = self._pairs()
        weight: float | torch.Tensor = 1 - self.decay
        if found_inf is not None:  # a skipped step moves nothing (masked on the device: no host sync)
            weight = (~found_inf.to(device=emas[0].device, dtype=torch.bool)).float() * (1 - self.decay)
        torch._foreach_lerp_(emas, [w.float() for w in weights], weight)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The parameters hold the average inside; the trained weights, bit for bit, after."""
        emas, weights = self._pairs()
        with torch.no_grad():
            saved = [w.clone() for w in weights]
            for w, ema in zip(weights, emas):
                w.copy_(ema)
            for refresh in self.after_swap:
                refresh()
        try:
            yield
        finally:
            with torch.no_grad():
                for w, s in zip(weights, saved):
                    w.copy_(s)
                for refresh in self.after_swap:
                    refresh()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.ema)


class EMAPart:
    """The checkpoint part `ema` (trainer/checkpoint/parts.py): the average's tensors by clean fqn; DCP loads them in
    place. `ema` None: train.ema_decay=0, nothing saved and a checkpoint's average left unused."""

    def __init__(self, ema: EMAWeights | None):
        self.ema = ema

    def state_dict(self) -> dict[str, Any]:
        return self.ema.state_dict() if self.ema is not None else {}

    def reconcile(self, sd: dict[str, Any], saved: dict[str, TensorStorageMetadata]) -> str | None:
        if not sd:
            return ("train.ema_decay=0: the checkpoint's EMA weights are not used (a later run from this run's "
                    "checkpoints has none)") if saved else None
        if all(k in saved for k in sd):
            return None
        sd.clear()
        self.ema.restart = True
        return ("train.ema_decay: the checkpoint has no EMA weights (saved with train.ema_decay=0): the average starts "
                "from the resumed weights")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert self.ema is not None and set(sd) == set(self.ema.ema), "DCP loaded the average in place"
        self.ema.restart = False  # the checkpoint's average goes on, not the weights'
