"""Multiple-choice accuracy during training ([[validation.tasks]]), in every parallel layout.

Every `validation.freq` steps and at the last step, beside the held-out loss (trainer/run/evaluate.py, whose
schedule, precision and forward path this shares), each task's choices are scored by the model as it trains:

    log-likelihood of a choice = - the summed loss of its tokens given the context      (trainer.data.tasks: the rows)
    acc      = the share of items whose highest log-likelihood choice is the answer
    acc_norm = the same with each log-likelihood divided by len(choice), its length in characters

acc_norm is lm-evaluation-harness's (`completion_len = [len(c) for c in choices]`: characters of the choice string,
not bytes nor tokens, so it does not depend on how a tokenizer splits the ending); ties go to the first choice, as
np.argmax. They are logged as `val/acc_norm/NAME` and `val/acc/NAME` to every tracker (the log line, metrics.jsonl,
TensorBoard, W&B).

Every task's rows go through the run's batch shape, train.batch_size rows of train.seq_len per data-parallel rank:
batch b of rank r holds rows [(b x dp + r) x batch_size, ... + batch_size) of all tasks' rows in order, the last
batch padded with rows of no valid label. Each rank's row sums (its chunks of them under context parallelism, sent
from the last stage under pipeline parallelism: `TrainStep.eval_row_losses`) are put in place in one vector of
every row, summed over the dp x cp ranks: every rank then picks the same answers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from trainer.data.tasks import TaskRows
from trainer.hooks import StepHook
from trainer.loss import IGNORE_INDEX
from trainer.metrics.logger import ACC_NORM
from trainer.run.evaluate import Evaluator, evaluating

logger = logging.getLogger(__name__)


def accuracies(log_likelihoods: np.ndarray, task: TaskRows) -> dict[str, float]:
    """{"acc", "acc_norm"} of `task` from each of its rows' log-likelihood (module docstring)."""
    right = {"acc": 0, "acc_norm": 0}
    starts = np.searchsorted(task.item, np.arange(task.num_items + 1))  # rows of an item are consecutive
    for i, answer in enumerate(task.answers):
        ll = log_likelihoods[starts[i]:starts[i + 1]]
        right["acc"] += int(np.argmax(ll)) == answer
        right["acc_norm"] += int(np.argmax(ll / task.chars[starts[i]:starts[i + 1]])) == answer
    return {k: v / task.num_items for k, v in right.items()}


class TaskScorer(StepHook):
    """[[validation.tasks]]' accuracies as a step hook (trainer/hooks.py), logged when the held-out loss is."""

    def __init__(self, tasks: tuple[TaskRows, ...], *, evaluator: Evaluator,
                 row_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """evaluator: the held-out loss's, whose schedule, batch size, ranks, precision and loss context these
        share. row_losses(inputs, labels) -> [batch] each row's summed loss in the training layout
        (`trainer.run.step.TrainStep.eval_row_losses`)."""
        self.tasks, self.evaluator, self.row_losses = tasks, evaluator, row_losses
        self.inputs = np.concatenate([t.inputs for t in tasks])
        self.labels = np.concatenate([t.labels for t in tasks])
        e = evaluator
        self.num_batches = math.ceil(len(self.inputs) / (e.batch_size * e.dp_degree))
        for task in tasks:
            logger.info("validation.tasks %r: %d items, %d choices scored every %d steps (acc_norm: by characters)%s",
                        task.name, task.num_items, len(task.item), e.freq,
                        f"; {task.truncated} row(s) longer than train.seq_len lost context tokens on the left"
                        if task.truncated else "")

    @classmethod
    def of(cls, tasks: tuple[TaskRows, ...], *, evaluator: Evaluator,
           losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[TaskScorer]:
        """The hook where the job has tasks (`losses`: the row_losses), else none."""
        return [cls(tasks, evaluator=evaluator, row_losses=losses)] if tasks else []

    def log_due(self, step: int) -> bool:
        return self.evaluator.log_due(step)

    def on_log(self, step: int) -> dict[str, float]:
        if not self.log_due(step):
            return {}
        ll = -self.score(self.evaluator.model)
        metrics, start = {}, 0
        for task in self.tasks:
            result = accuracies(ll[start:start + len(task.item)], task)
            start += len(task.item)
            metrics |= {f"{ACC_NORM}{task.name}": result["acc_norm"], f"val/acc/{task.name}": result["acc"]}
        return metrics

    def batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(inputs, labels, first row) of this rank's batch b; rows past the last are padding of no valid label."""
        e = self.evaluator
        first = (b * e.dp_degree + e.dp_rank) * e.batch_size
        inputs = np.zeros((e.batch_size, self.inputs.shape[1]), dtype=np.int64)
        labels = np.full_like(inputs, IGNORE_INDEX)
        rows = max(0, min(e.batch_size, len(self.inputs) - first))
        inputs[:rows], labels[:rows] = self.inputs[first:first + rows], self.labels[first:first + rows]
        return torch.from_numpy(inputs), torch.from_numpy(labels), first

    def score(self, model: torch.nn.Module) -> np.ndarray:
        """[rows] every task row's summed loss (minus its log-likelihood), in float64; the same on every rank."""
        e = self.evaluator
        total = torch.zeros(self.num_batches * e.dp_degree * e.batch_size, dtype=torch.float64, device=e.device)
        with evaluating(model, e.bf16_matmuls):
            for b in range(self.num_batches):
                inputs, labels, first = self.batch(b)
                with e.loss_context():
                    total[first:first + e.batch_size] = self.row_losses(inputs, labels).double()
        if e.dp_group is not None and dist.get_world_size(e.dp_group) > 1:
            # Each row on its data-parallel rank, summed over the context-parallel ranks' chunks of it.
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=e.dp_group)
        return total[:len(self.inputs)].cpu().numpy()
