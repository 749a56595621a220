"""One optimizer step for every layout: forward/backward over the microbatches, grad norm, clipping, the skip.

    TrainStep(microbatches, step) -> StepResult(loss, grad_norm, found_inf)     (device tensors, no host sync)

At pp=1 the step runs `loss_fn.sum(model(inputs), labels)` per microbatch; under pipeline
parallelism the schedule runs the stages and calls the same `loss_fn.sum` on the last one
(trainer/parallel/pipeline.py). Either way each microbatch's summed loss is multiplied by one
factor before its backward: loss scale x D / N, with N the valid labels (not IGNORE_INDEX) of the
whole global batch (every microbatch, data-parallel rank and context-parallel chunk; one all-reduce
of a count per step) and D the ranks whose gradients FSDP2 and HSDP average (dp x cp). So the step's
gradient is the gradient of the mean loss over every valid token of the step, however many each
microbatch holds (torchtitan's global valid-token count), and the reported loss is that mean. The
MoE layers' auxiliary losses are per microbatch: loss scale / (pipeline microbatches x the step's accumulation
microbatches, fewer in a batch-size warm-up step), injected through autograd (`trainer.models.moe.attach_aux_loss`).

A non-finite gradient norm (or an fp16 overflow) skips the optimizer step on the device:
the fused AdamW kernel takes `found_inf`, and the hooks (trainer/hooks.py) get it to mask
their own updates. `check_finite` reads the norms on the host, at log steps only.

A step whose global batch holds no valid label (every label masked: data.eod_mask_loss on data of end-of-document
tokens only) has nothing to learn from: its loss would read 0 and AdamW would still move every weight by its
momentum and weight decay. It is skipped on the device like a non-finite one, and `check_finite` stops the run
with one line (a DataError): as in Megatron-LM and torchtitan, whose mean over the valid tokens divides by zero
there and stops (or ruins) the run, a batch with nothing to learn from is a data pipeline to fix, not one to skip
past silently.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement

from trainer.data.shards import DataError
from trainer.errors import UserError, on_every_rank
from trainer.hooks import StepHook
from trainer.loss import IGNORE_INDEX, LossFn, local_loss
from trainer.models.moe import MoE, set_aux_loss_scale
from trainer.run.train_state import TrainState

if TYPE_CHECKING:
    from trainer.parallel.context_parallel import ContextParallel
    from trainer.parallel.pipeline import Pipeline

logger = logging.getLogger(__name__)


class NonFiniteError(UserError, RuntimeError):
    """A NaN/inf loss or gradient norm with train.on_nonfinite='stop'."""

    every_rank = True  # the gradient norm is reduced over every rank: all see the same steps as non-finite


class LossScaler:
    """Dynamic loss scaling for fp16 (bf16/fp8 need none), kept on the device.

    Scale and growth counter are device tensors updated with torch.where, so fp16
    needs no host sync per step; works on DTensor gradients, unlike
    torch.amp.GradScaler with FSDP2.
    """

    def __init__(self, *, enabled: bool, device: torch.device, init_scale: float = 2.0**16,
                 growth_interval: int = 2000):
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.scale = torch.tensor(init_scale if enabled else 1.0, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        if not self.enabled:
            return
        self.good_steps = torch.where(found_inf, 0, self.good_steps + 1)
        grow = self.good_steps >= self.growth_interval
        self.scale = torch.where(found_inf, self.scale / 2, torch.where(grow, self.scale * 2, self.scale))
        self.good_steps = torch.where(grow, 0, self.good_steps)

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale.item(), "good_steps": int(self.good_steps.item())}

    def load_state_dict(self, sd: dict[str, float | int]) -> None:
        self.scale.fill_(float(sd["scale"]))
        self.good_steps.fill_(int(sd["good_steps"]))


class LossScalerPart:
    """The loss scaler's part of a checkpoint (trainer/checkpoint/parts.py): an fp16 run resumes the scale of an fp16
    run's checkpoint; every other pair keeps the scaler's initial scale. `train_state` (loaded before this part) says
    what the checkpoint's run was."""

    def __init__(self, scaler: LossScaler, train_state: TrainState):
        self.scaler, self.train_state = scaler, train_state

    def state_dict(self) -> dict[str, float | int]:
        return self.scaler.state_dict()

    def load_state_dict(self, sd: dict[str, float | int]) -> None:
        if self.scaler.enabled and self.train_state.resumed_mixed_precision == "fp16":
            self.scaler.load_state_dict(sd)


def grad_norm(params: list[torch.nn.Parameter], *, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """True global L2 norm over all gradients (DTensors on any mesh), in fp32, as a plain device tensor.

    Computed on the local shards, one fused `_foreach_norm` per mesh and placement: each group's sum of
    squares is all-reduced over the mesh dims it is sharded on (not over those it is replicated on, e.g.
    HSDP's replicas), so the result equals DTensor's own norm without dispatching every gradient through
    DTensor (measured: that dispatch was most of the optimizer step's overhead on one H100). Under
    pipeline parallelism each pp rank holds other parameters: pp_group sums the squares too.
    """
    groups: dict[tuple[DeviceMesh, tuple[Placement, ...]] | None, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g._local_tensor if isinstance(g, DTensor) else g)
    squares = []
    for key, grads in groups.items():
        sq = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                assert not placement.is_partial(), f"a partial gradient on {mesh}: {placements}"
                # Shard and _StridedShard (FSDP's dim when TP shards the same tensor dim; not a Shard subclass).
                if not placement.is_replicate() and mesh.size(dim) > 1:
                    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        squares.append(sq)
    total = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
    return total.sqrt()


@dataclass
class StepResult:
    loss: torch.Tensor
    """This rank's summed loss x D / N (module docstring): its average over the dp x cp ranks is the step's mean loss
    per valid token (the same on every pp and tp rank)."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping (divided by the fp16 loss scale)."""
    found_inf: torch.Tensor
    """True when the step was skipped (non-finite norm)."""


class TrainStep:
    """Forward/backward, gradient accumulation, grad norm, clipping, the non-finite skip and the optimizer step.

    `pipeline` (trainer.parallel.pipeline.Pipeline) runs forward/backward when pp > 1; otherwise
    `model` and `loss_fn` do. `loss_context` is entered around each loss's forward and backward
    (TP's loss_parallel).
    """

    def __init__(self, *, model: nn.Module, loss_fn: LossFn | None, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: LossScaler, max_norm: float, fused: bool, device: torch.device,
                 pipeline: Pipeline | None = None,
                 loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 cp: ContextParallel | None = None, dp_cp_group: dist.ProcessGroup | None = None):
        """loss_fn: trainer.loss.LossFn (None on pipeline ranks without the last stage). cp: the model's
        context-parallel layout (trainer.parallel.context_parallel.ContextParallel): each batch is cut to this
        rank's chunks of every sequence before it runs. dp_cp_group: the ranks that read other tokens of the
        step (data-parallel and context-parallel), whose gradients FSDP2 averages; None: one."""
        self.model, self.loss_fn, self.pipeline, self.cp = model, loss_fn, pipeline, cp
        self.dp_cp_group = dp_cp_group if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1 else None
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.max_norm, self.fused, self.device = max_norm, fused, device
        self.loss_context = loss_context
        self.params = [p for p in model.parameters() if p.requires_grad]
        # A pipeline stage's copy of another stage's weight (MTP's embeddings) counts once in the norm, there.
        copies = {id(p) for p in pipeline.copied_params} if pipeline is not None else set()
        self.norm_params = [p for p in self.params if id(p) not in copies]
        self.moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
        self._pending_norms: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, grad norm, valid labels)
        self._valid_labels = torch.ones((), device=device)  # the last forward_backward's, over the dp x cp ranks

    def __call__(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]], step: int,
                 hooks: Sequence[StepHook] = ()) -> StepResult:
        """Forward/backward over the microbatches and one optimizer step, without a host sync; between the two, each
        hook's `after_forward_backward` (trainer/hooks.py)."""
        loss = self.forward_backward(microbatches)
        for hook in hooks:
            hook.after_forward_backward(step)
        norm, found_inf = self.optimizer_step(step)
        return StepResult(loss=loss, grad_norm=norm, found_inf=found_inf)

    def optimizer_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grad norm, clipping, the non-finite skip and the update, then the gradients freed and the LR moved:
        (global grad norm, found_inf). What scripts/benchmark.py times as the optimizer step."""
        norm = grad_norm(self.norm_params, pp_group=self.pipeline.pp_group if self.pipeline is not None else None)
        if self.scaler.enabled:
            norm = norm / self.scaler.scale
        overflow = ~torch.isfinite(norm)
        found_inf = overflow | (self._valid_labels == 0)  # nothing to learn from: skipped too (module docstring)
        self._optimizer_step(norm, found_inf)
        self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._pending_norms.append((step, norm, self._valid_labels))
        return norm, found_inf

    def forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The step's gradients, accumulated in the parameters (no optimizer step); returns the mean loss."""
        microbatches = [self._this_ranks(inputs, labels) for inputs, labels in microbatches]
        per_batch = self.pipeline.num_microbatches if self.pipeline is not None else 1
        scale = self.scaler.scale if self.scaler.enabled else 1.0  # fp16's loss scale
        set_aux_loss_scale(self.moe_layers, scale / (len(microbatches) * per_batch))
        self._valid_labels = self._count_valid(microbatches)
        factor = scale * self._ranks / self._valid_labels.clamp(min=1.0)  # no valid label: zero loss, and skipped
        if self.pipeline is not None:
            return self.pipeline.forward_backward(microbatches, loss_factor=factor, loss_scale=scale,
                                                  loss_context=self.loss_context)
        return self._forward_backward(microbatches, factor) / scale

    def _this_ranks(self, inputs: torch.Tensor, labels: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, labels, documents) of one batch as this rank runs them: under context parallelism its chunks of
        every sequence, and the whole rows' tokens that document masking reads the documents from (the model's
        `documents`; None without cp, where the inputs are the whole rows)."""
        if self.cp is None:
            return inputs, labels, None
        return self.cp.shard(inputs), self.cp.shard(labels), inputs

    @property
    def _ranks(self) -> int:
        """D (module docstring): the ranks whose gradients FSDP2 averages."""
        return dist.get_world_size(self.dp_cp_group) if self.dp_cp_group is not None else 1

    def _count_valid(self, microbatches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
                     ) -> torch.Tensor:
        """N (module docstring) as a device tensor: counted on the host from this rank's labels, then summed over
        the dp x cp ranks (an asynchronous all-reduce of one number; no host sync)."""
        valid = sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in microbatches)
        # A fill kernel with the count as its argument. Not torch.tensor(valid, device=...): that copies from pageable
        # host memory and waits for the device to finish everything queued, the previous step whole, so the next
        # step's first kernels reached an idle GPU late (one such wait a step in the 2026-11-27 dp_shard=2 traces).
        count = torch.full((), float(valid), device=self.device)
        if self.dp_cp_group is not None:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.dp_cp_group)
        return count

    def _forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                          factor: torch.Tensor) -> torch.Tensor:
        """Each microbatch's summed loss x factor, backward; returns their sum."""
        total = torch.zeros((), device=self.device)
        for inputs, labels, documents in microbatches:
            with self.loss_context():
                loss = local_loss(self.loss_fn.sum(self._model(inputs, documents),
                                                   labels.to(self.device, non_blocking=True))) * factor
                loss.backward()
            total += loss.detach()
        return total

    def _optimizer_step(self, norm: torch.Tensor, found_inf: torch.Tensor) -> None:
        # Clipping factor >= 1 that the gradients are divided by.
        clip = torch.clamp(norm / self.max_norm, min=1.0) if self.max_norm > 0 else torch.ones_like(norm)
        if self.fused:
            # The fused AdamW kernel divides gradients by grad_scale (loss scale x clip)
            # and skips the whole update when found_inf is set: clipping and the
            # non-finite skip cost no extra pass over the gradients and no host sync.
            self.optimizer.grad_scale = (self.scaler.scale * clip).nan_to_num(1.0)
            self.optimizer.found_inf = found_inf.float()
            self.optimizer.step()
            return
        # note: a CPU-GPU sync point (only with optimizer.implementation='foreach').
        if found_inf.item():
            return
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params]
        torch._foreach_div_(grads, self.scaler.scale * clip)
        self.optimizer.step()

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(summed loss, valid labels) of this rank's part of one held-out batch, in the training layout (forward
        only)."""
        inputs, labels, documents = self._this_ranks(inputs, labels)
        valid = int((labels != IGNORE_INDEX).sum())
        if self.pipeline is not None:
            return self.pipeline.eval_loss(inputs, labels, documents), valid
        return local_loss(self.loss_fn.sum(self._model(inputs, documents), labels.to(self.device))), valid

    def eval_row_losses(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[batch] each row's summed loss of its valid labels (this rank's chunks of them under cp), in the training
        layout, forward only, as `eval_loss` runs (trainer/run/tasks.py scores choices with it)."""
        inputs, labels, documents = self._this_ranks(inputs, labels)
        if self.pipeline is not None:
            return self.pipeline.eval_row_losses(inputs, labels, documents)
        return self.loss_fn.row_sums(self._model(inputs, documents), labels.to(self.device))

    def _model(self, inputs: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The model's hidden states of this rank's inputs (pp=1); `documents` only where there are any (cp)."""
        inputs = inputs.to(self.device, non_blocking=True)
        if documents is None:
            return self.model(inputs)
        return self.model(inputs, documents.to(self.device, non_blocking=True))

    def check_finite(self, *, on_nonfinite: str, record: Callable[[], None]) -> int:
        """Report the non-finite steps since the last check; raise NonFiniteError under on_nonfinite='stop'.

        note: a CPU-GPU sync point; the loop calls it at log steps (and before saving). `record` counts
        each non-finite step for the metrics (fp16 overflows are not counted: the scaler handles them).
        Returns the number of non-finite steps found.
        """
        if not self._pending_norms:
            return 0
        steps = [s for s, _, _ in self._pending_norms]
        norms, counts = torch.stack([torch.stack([n.float(), c.float()]) for _, n, c in self._pending_norms]).T.tolist()
        self._pending_norms.clear()
        if empty := [s for s, count in zip(steps, counts) if count == 0]:
            raise on_every_rank(DataError(
                f"step {empty[0]} has nothing to learn from: every label of its global batch is masked (IGNORE_INDEX; "
                "data.eod_mask_loss masks the label after each end-of-document token, so data of such tokens alone "
                f"has none), and it was skipped{f' (so were {len(empty) - 1} more since)' if len(empty) > 1 else ''}"
                "; check the data and data.eod_mask_loss (docs/data.md#the-loss-a-mean-over-the-steps-valid-tokens)"))
        bad = [(s, x) for s, x in zip(steps, norms) if not math.isfinite(x)]
        for step, value in bad:
            if self.scaler.enabled:
                logger.warning("step %d: fp16 overflow (grad_norm=%s), step skipped; loss scale now %g",
                               step, value, self.scaler.scale.item())
                continue
            record()
            message = f"non-finite loss or gradient at step {step} (grad_norm={value}); the step was not applied"
            if on_nonfinite == "stop":
                raise NonFiniteError(
                    message + ". Stopping: lower optimizer.lr or raise scheduler.warmup_steps, "
                    "or set train.on_nonfinite='skip' to skip such steps (see docs/debug.md)"
                )
            logger.warning("%s (train.on_nonfinite='skip')", message)
        return len(bad)
