"""Held-out loss and perplexity during training, in every parallel layout.

Each evaluation reads the same batches: batch b of data-parallel rank r is the held-out
samples [(b * dp_degree + r) * batch_size, ... + batch_size), in order. The loss is the
mean over every valid token of every batch on every data-parallel rank, computed with the
model as it trains (FSDP2/TP sharding, FP8 linears, compiled), under no_grad; with
`validation.mixed_precision = "bf16"` an fp8 run's matmuls run in bf16 for it. A data mixture
with a held-out set per source (trainer.data.mix.HeldOutMixture) gets that mean per source
(`val/loss/NAME`, `steps` batches each) and, as `val_loss`, their mean weighted as the mixture is.

A source whose held-out batches hold no valid label (every label masked by data.eod_mask_loss) has no loss to report:
its labels are counted once when the evaluator is built (only under data.eod_mask_loss: without it every label is
valid), and it is left out of `val_loss` and the metrics with one warning line naming it; a held-out set with no
valid label at all stops the run before its first step (a DataError), rather than report a loss of 0.

[[validation.tasks]]' multiple-choice accuracy (trainer/run/tasks.py) is scored on the same steps, with the same
batch shape, ranks, precision and forward (`evaluating`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainer.checkpoint.ema import EMAWeights
from trainer.data.loader import split_rows
from trainer.data.mix import HeldOutMixture, MixEntry
from trainer.data.shards import DataError
from trainer.errors import on_every_rank
from trainer.hooks import StepHook
from trainer.loss import IGNORE_INDEX, local_loss
from trainer.parallel.float8 import Float8Report, bf16_matmuls as matmuls_in_bf16

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module, bf16_matmuls: Float8Report | None) -> Iterator[None]:
    """The model in eval mode under no_grad, an fp8 model's matmuls in bf16 where `bf16_matmuls` is its report
    (validation.mixed_precision='bf16'); then back in training mode with its FSDP2 weights resharded."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), (matmuls_in_bf16(model, bf16_matmuls) if bf16_matmuls is not None
                               else contextlib.nullcontext()):
            yield
    finally:
        model.train(was_training)
        # With reshard_after_forward off, a forward without backward leaves the gathered weights
        # registered as the parameters; the optimizer and checkpoints need the sharded ones back.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


class Evaluator(StepHook):
    """Held-out loss as a step hook (trainer/hooks.py): every `freq` steps and at step `last_step`, the
    log line gets `val_loss` and `val_ppl`; the loop does not count the evaluation as training time."""

    def __init__(self, source, *, model: torch.nn.Module, batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 seq_len: int, batch_size: int, steps: int, freq: int, last_step: int, dp_rank: int, dp_degree: int,
                 device: torch.device, dp_group: dist.ProcessGroup | None = None,
                 loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 eod_mask_id: int | None = None, bf16_matmuls: Float8Report | None = None,
                 ema: EMAWeights | None = None):
        """batch_loss(inputs, labels) -> (summed loss, valid labels) of this rank's part of the batch in the training
        layout (`trainer.run.step.TrainStep.eval_loss`; under pipeline parallelism through the schedule).
        bf16_matmuls: validation.mixed_precision='bf16': the FP8 report of the model, whose converted modules run in
        bf16 while it evaluates (`trainer.parallel.float8.evaluation.bf16_matmuls`); None evaluates as it trains.
        ema: train.ema_decay's average (trainer/checkpoint/ema.py), evaluated swapped in as `val_loss_ema` too."""
        # trainer.validate checked that steps * batch_size * dp_degree held-out samples exist.
        assert steps * batch_size * dp_degree <= source.num_samples(seq_len)
        self.source, self.seq_len, self.batch_size, self.steps = source, seq_len, batch_size, steps
        self.parts = list(source.entries) if isinstance(source, HeldOutMixture) else [MixEntry("", 1.0, source)]
        self.model, self.freq, self.last_step = model, freq, last_step
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.device, self.dp_group, self.loss_context = device, dp_group, loss_context
        self.batch_loss = batch_loss
        self.eod_mask_id, self.bf16_matmuls, self.ema = eod_mask_id, bf16_matmuls, ema
        if eod_mask_id is not None:
            self.parts = self._parts_with_labels(source)
        self.tokens = len(self.parts) * steps * batch_size * dp_degree * seq_len  # per evaluation, over all ranks

    def log_due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def on_log(self, step: int) -> dict[str, float]:
        if not self.log_due(step):
            return {}
        result = self.evaluate(self.model)
        metrics = {"val_loss": result["loss"], "val_ppl": result["ppl"],
                   **{f"val/loss/{name}": loss for name, loss in result.get("by_source", {}).items()}}
        if self.ema is not None:  # the same batches with the average swapped in; the trained weights restored exactly
            with self.ema.swapped_in():
                metrics["val_loss_ema"] = self.evaluate(self.model)["loss"]
        return metrics

    def batches(self, source) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's held-out batches of `source` (one of self.parts')."""
        for b in range(self.steps):
            start = (b * self.dp_degree + self.dp_rank) * self.batch_size
            rows = np.stack([source.get_sample(i, self.seq_len) for i in range(start, start + self.batch_size)])
            yield split_rows(rows, eod_mask_id=self.eod_mask_id)

    def _parts_with_labels(self, source) -> list[MixEntry]:
        """The parts whose held-out batches hold a valid label on some rank (one all-reduce of the counts); a warning
        naming the others, a DataError when none has one (module docstring)."""
        valid = torch.tensor([sum(int((labels != IGNORE_INDEX).sum()) for _, labels in self.batches(part.source))
                              for part in self.parts], dtype=torch.float64, device=self.device)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(valid, op=dist.ReduceOp.SUM, group=self.dp_group)
        counts = valid.tolist()  # note: a host sync, once
        empty = [part for part, count in zip(self.parts, counts) if count == 0]
        what = (f"{self.steps} batch(es) of {self.batch_size} x {self.dp_degree} rank(s), every label masked by "
                "data.eod_mask_loss (the label after each end-of-document token)")
        if len(empty) == len(self.parts):
            raise on_every_rank(DataError(
                f"validation: the held-out data ({source!r}) has no valid label to compute a loss on ({what}); "
                "point validation at held-out text with more than end-of-document tokens, or set "
                "validation.enable=false"))
        if empty:
            logger.warning("validation: held-out source(s) %s have no valid label (%s): left out of val_loss, the "
                           "weighted mean of the other sources", ", ".join(repr(p.name) for p in empty), what)
        return [part for part in self.parts if part not in empty]

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """{"loss": mean held-out token loss, "ppl": its exp, and for a mixture "by_source": {name: its loss}}; the
        same on every rank."""
        with evaluating(model, self.bf16_matmuls):
            # Per source, [summed loss, valid labels] over this rank's batches, then over every rank's: the mean per
            # valid token.
            total = torch.zeros(len(self.parts), 2, device=self.device, dtype=torch.float32)
            for i, part in enumerate(self.parts):
                for inputs, labels in self.batches(part.source):
                    with self.loss_context():
                        loss, valid = self.batch_loss(inputs, labels)
                    total[i, 0] += local_loss(loss).float()
                    total[i, 1] += valid
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                # Every data-parallel rank's batches, and every context-parallel rank's chunks of them.
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
            losses = (total[:, 0] / total[:, 1].clamp(min=1)).tolist()
        weights = [p.weight for p in self.parts]
        loss = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
        result = {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf}
        if len(self.parts) > 1 or self.parts[0].name:
            result["by_source"] = {p.name: x for p, x in zip(self.parts, losses)}
        return result
