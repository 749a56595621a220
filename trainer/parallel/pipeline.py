"""Pipeline parallelism with torch.distributed.pipelining: the runtime (stage modules, schedule, step).

The layout arithmetic (splits, which rank runs which stage, the bubble) is trainer/parallel/pipeline_layout.py.
The model is split by fqn. Every stage module is the whole model, built on the meta
device by the same builder as at pp=1 (`trainer.parallel.build.build_model_part`, any family), with
the blocks of other stages deleted and, off the edge stages, the embedding, final norm
and output head set to None (the torchtitan way), so every parameter keeps the fqn it
has in the full model: FP8 filters, the TP plan, checkpoints (DCP reshards by fqn) and
the HF export see the same names at any pp. Each stage then gets the same
`build_parallel_model` (TP -> FP8 -> AC -> compile -> FSDP2) as a pp=1 model, and fills
its weights with the per-fqn seeded init, so the stages together start from exactly the
pp=1 weights. Each stage returns hidden states, and the schedule hands the last stage's
to the same loss function the trainer uses at pp=1 (`trainer.loss.LossFn`, built for the
last stage by the `build_loss` the trainer passes in).

Stages are numbered 0..num_stages-1 along the model; rank r of the pp axis runs
stages r, r+pp, r+2pp, ... (loop style: GPipe, 1F1B, Interleaved*) or, for the V
schedule (ZBVZeroBubble), stages r and num_stages-1-r.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from trainer.log import info_silenced
from trainer.loss import local_loss
from trainer.models import ModelArgs
from trainer.parallel.apply import BuildOptions
from trainer.parallel.build import build_model_part
from trainer.parallel.context_parallel import ContextParallel
from trainer.parallel.float8 import Float8Report
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.pipeline_layout import (
    SINGLE_STAGE_SCHEDULES, PipelineOptions, bubble_fraction, describe_split, stage_ids,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Stage modules and the container the optimizer and checkpoints see


class PipelineModel(nn.Module):
    """This rank's stage modules as one module whose parameter fqns are the full model's.

    The optimizer and the checkpoint see this: `state_dict()` keys are the original
    fqns (`layers.2.attention.q_proj.weight`), so DCP reshards between any pp layouts.
    The modules are shared with the stages, not copied. It has no forward: the
    pipeline schedule runs the stages.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = tuple(parts)  # not submodules: their parameters are already these, under the same fqns
        # The first stage's embeddings, or the last stage's copy of them (DeepSeek-V3's MTP modules; a rank holds
        # no stage with either where they are not the same rank's: trainer.validate refuses the V schedule).
        first = next((p for p in parts if p.tok_embeddings is not None), None)
        last = next((p for p in parts if p.output_head is not None), None)
        self.tok_embeddings = first.tok_embeddings if first is not None else None
        blocks = {name: block for p in parts for name, block in p.layers.items()}
        self.layers = nn.ModuleDict({name: blocks[name] for name in sorted(blocks, key=int)})
        self.norm = last.norm if last is not None else None
        self.output_head = last.output_head if last is not None else None

    def train(self, mode: bool = True) -> PipelineModel:
        """The stage modules too: a model's forward may read its own `training` (DeepSeek-V3 runs its MTP modules
        in training only)."""
        for part in self.parts:
            part.train(mode)
        return super().train(mode)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineModel has no forward: run the pipeline schedule (Pipeline.forward_backward)")


# ---------------------------------------------------------------------------
# The pipeline: stages, schedule and the forward/backward of one optimizer step


def _schedule_class(name: str):
    return {
        "GPipe": schedules.ScheduleGPipe,
        "1F1B": schedules.Schedule1F1B,
        "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
        "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
        "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
    }[name]




class Pipeline:
    """This rank's stages, their schedule, and the forward/backward of one optimizer step."""

    def __init__(self, model_args: ModelArgs, parallel_dims: ParallelDims, *, options: PipelineOptions,
                 build: BuildOptions, device: torch.device, seed: int, seq_len: int,
                 build_loss: Callable[[nn.Module], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]):
        """build_loss(last stage module) -> loss_fn(hidden states, labels): the trainer's loss function."""
        self.options = options
        self.device = device
        pp_mesh = parallel_dims.mesh("pp")
        self.pp_group = pp_mesh.get_group()
        self.pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
        self.stage_ids = stage_ids(self.pp_rank, pp, options.num_stages, v_style=options.v_style)
        # What the schedule's loss is multiplied by before its backward (set per step by the caller:
        # loss scale / every microbatch of the optimizer step).
        self._loss_factor: torch.Tensor | float = 1.0
        self._rows: list[torch.Tensor] | None = None  # eval_row_losses's row sums while it runs

        parts, results = [], []
        for sid in self.stage_ids:
            # The first stage's build lines say how every stage is built; the others' would repeat them.
            if not parts:
                logger.info("pipeline stage %d/%d first (this rank's others are built alike, the split follows):",
                            sid, options.num_stages)
            with info_silenced() if parts else contextlib.nullcontext():
                # The same builder as the pp=1 model's (trainer.parallel.build), on this stage's modules.
                part, result = build_model_part(model_args, parallel_dims, options=build, device=device, seed=seed,
                                                fqns=options.stage_fqns[sid])
            parts.append(part)
            results.append(result)
        logger.info(describe_split(options.stage_fqns, options.stage_costs, self.stage_ids, self.pp_rank))
        self.parts = parts
        self.model = PipelineModel(parts)
        self.float8_report = self._gather_float8_reports([r.float8 for r in results])
        # Every stage's: the same chunk layout (None without context parallelism).
        self.cp: ContextParallel | None = results[0].cp
        last = next((p for p in parts if p.output_head is not None), None)
        self.loss_fn = build_loss(last) if last is not None else None
        # What crosses a stage boundary: this rank's sequence shard (sequence parallel under TP; under CP the
        # caller gives seq_len // cp, this rank's chunks) of one
        # microbatch's hidden states, in the compute dtype (FSDP2's param_dtype, else the master dtype).
        self._hidden = torch.empty(
            (options.microbatch_size, seq_len // parallel_dims.tp, model_args.dim),
            dtype=build.fsdp.param_dtype or build.fsdp.master_dtype, device="meta", requires_grad=True,
        )
        self._tokens = torch.empty((options.microbatch_size, seq_len), dtype=torch.int64, device="meta")
        self.schedule = self._build_schedule(parts)
        # data.document_masking: every stage reads the documents of its microbatch from the rows' tokens, which the
        # schedule splits into microbatches with the inputs (a keyword argument reaches every stage's forward).
        self.document_masking = build.document_eos is not None
        self.has_first = any(s.is_first for s in self._stages)
        self.has_last = any(s.is_last for s in self._stages)
        # DeepSeek-V3's MTP modules on the last stage look up the tokens ahead in a copy of the embeddings: they and
        # their ids (the rows' tokens, as `documents`) reach it; its gradient is summed with the first stage's.
        self.mtp = bool(getattr(model_args, "mtp_layers", 0))
        self.copied_params, self._copy_peer = self._embedding_copy(pp)

    def _embedding_copy(self, pp: int) -> tuple[tuple[nn.Parameter, ...], int | None]:
        """(the parameters this rank holds as a copy of another pp rank's, which the grad norm counts there; the
        global rank that holds the embeddings' other end): the last stage's copy of the embeddings under MTP."""
        if not self.mtp:
            return (), None
        assert not (self.has_first and self.has_last), "MTP under a V schedule: trainer.validate refuses it"
        if not (self.has_first or self.has_last):
            return (), None
        peer = dist.get_global_rank(self.pp_group, pp - 1 if self.has_first else 0)
        return ((self.model.tok_embeddings.weight,) if self.has_last else ()), peer

    def _sum_embedding_grads(self) -> None:
        """The embeddings' gradient of the first stage plus its copy's of the last (MTP): the same sum on both
        ranks (a + b = b + a in floating point), so their AdamW updates keep the two tables equal. Each rank's
        local shard: the two ends shard alike (the same dp x cp x tp coordinates over pp)."""
        if self._copy_peer is None:
            return
        grad = self.model.tok_embeddings.weight.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        other = torch.empty_like(local)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, local, self._copy_peer),
                                           dist.P2POp(dist.irecv, other, self._copy_peer)]):
            req.wait()
        local += other

    def _gather_float8_reports(self, reports: list[Float8Report | None]) -> Float8Report | None:
        """Every stage's FP8 report, from every pp rank, merged (`Float8Report.of_stages`): the whole model's,
        whose lines over all stages rank 0 logs (each stage's own counted its layers only) and which feeds the
        metrics and the step hooks. None when the run is not fp8."""
        if all(r is None for r in reports):
            return None
        gathered: list = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, list(zip(self.stage_ids, reports)), group=self.pp_group)
        stages = [report for _, report in sorted((sid, report) for part in gathered for sid, report in part)]
        assert len(stages) == self.options.num_stages, (len(stages), self.options.num_stages)
        merged = Float8Report.of_stages(stages)
        for line in merged.stages_lines(stages):
            logger.info(line)
        return merged

    @property
    def num_microbatches(self) -> int:
        return self.options.num_microbatches

    def _build_schedule(self, parts: list[nn.Module]):
        o = self.options
        # The boundary shapes are given, not inferred: torch would otherwise run each stage once on
        # placeholder tensors at the first step, and an MoE layer would count that forward's routing.
        self._stages = [PipelineStage(part, sid, o.num_stages, self.device, group=self.pp_group,
                                      input_args=self._tokens if sid == 0 else self._hidden, output_args=self._hidden)
                        for part, sid in zip(parts, self.stage_ids)]
        single = o.schedule in SINGLE_STAGE_SCHEDULES
        schedule = _schedule_class(o.schedule)(self._stages[0] if single else self._stages,
                                               n_microbatches=o.num_microbatches, loss_fn=self._loss,
                                               scale_grads=False)
        # return_outputs=False keeps the last stage from concatenating every microbatch's outputs
        # after the step; older torch has no such argument and always returns them.
        self._step_kwargs = (
            {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}
        )
        pp = dist.get_world_size(self.pp_group)
        logger.info(
            "pipeline: schedule=%s%s, %d stages (%d per rank), %d microbatches of %d sequences; "
            "bubble ~%.0f%% of the step", o.schedule, f" ({o.schedule_choice})" if o.schedule_choice else "",
            o.num_stages, o.stages_per_rank, o.num_microbatches, o.microbatch_size,
            100 * bubble_fraction(pp=pp, num_microbatches=o.num_microbatches, stages_per_rank=o.stages_per_rank),
        )
        return schedule

    def _loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The schedule calls this on the last stage for every microbatch and backpropagates what it returns
        # (torch may also call it once on placeholder outputs, e.g. while inferring shapes: the step's losses
        # are the ones the schedule hands back).
        if self._rows is not None:  # eval_row_losses: each row's sum kept, their total handed to the schedule
            self._rows.append(self.loss_fn.row_sums(h, labels))
            return self._rows[-1].sum()
        return local_loss(self.loss_fn.sum(h, labels)) * self._loss_factor

    def forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], *,
                         loss_factor: torch.Tensor | float, loss_scale: torch.Tensor | float = 1.0,
                         loss_context=contextlib.nullcontext) -> torch.Tensor:
        """Run the schedule over each batch of the optimizer step; gradients accumulate in the parameters.

        microbatches: (inputs, labels, documents) as trainer.run.step.TrainStep cuts them: documents are the whole
        rows' tokens under context parallelism (the inputs are this rank's chunks), else None (the inputs are).

        loss_factor: what each microbatch's summed loss is multiplied by before its backward (loss scale x
        the step's data-parallel ranks / its valid labels: trainer/run/step.py). loss_context: entered around each
        schedule step, i.e. around the loss's forward and backward (TP's loss_parallel, for logits sharded
        over the vocabulary). Returns the sum of the microbatches' losses x loss_factor / loss_scale on every
        pp rank (sent from the last stage by a sum over the pp group, where only the last stage's ranks hold
        losses).
        """
        self._loss_factor = loss_factor
        losses: list[torch.Tensor] = []
        for inputs, labels, documents in microbatches:
            with loss_context():
                losses += self._run_schedule(self.schedule.step, inputs, labels, documents)
        self._sum_embedding_grads()
        return self._total_loss(losses) / loss_scale

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The summed loss of one batch's valid labels through the schedule, forward only (`schedule.eval`), on
        every pp rank. The same microbatches as a training step of this batch.
        """
        self._loss_factor = 1.0
        return self._total_loss(self._run_schedule(self.schedule.eval, inputs, labels, documents))

    @torch.no_grad()
    def eval_row_losses(self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """[batch] each row's summed loss of its valid labels through the schedule, forward only, on every pp rank:
        the last stage's loss keeps each microbatch's row sums, which the schedule computes in microbatch order."""
        self._rows = []
        try:
            self._run_schedule(self.schedule.eval, inputs, labels, documents)
            assert not self.has_last or len(self._rows) == self.num_microbatches, len(self._rows)
            rows = torch.cat(self._rows) if self.has_last else torch.zeros(inputs.shape[0], device=self.device)
        finally:
            self._rows = None
        dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=self.pp_group)  # from the last stage's ranks
        return rows

    def _run_schedule(self, run, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None
                      ) -> list[torch.Tensor]:
        """One schedule call (`step` or `eval`) on one batch: the last stage's microbatch losses (each times
        `_loss_factor`, detached), none on ranks without the last stage."""
        args = (inputs.to(self.device, non_blocking=True),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels.to(self.device, non_blocking=True), "losses": losses} if self.has_last else {}
        # Document masking and the last stage's MTP modules read the rows' token ids (the whole rows under cp):
        # every pp rank reads the batch (the same data-parallel rank's).
        if self.document_masking or self.mtp:
            kwargs["documents"] = (inputs if documents is None else documents).to(self.device, non_blocking=True)
        run(*args, **kwargs, **self._step_kwargs)
        # Replicated DTensors under loss parallel: every TP rank holds the whole loss.
        return [(x.to_local() if isinstance(x, DTensor) else x).detach() for x in losses]

    def _total_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the microbatches' losses on every pp rank: sent from the last stage by a sum over the pp
        group, where only the last stage's ranks hold losses."""
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pp_group)
        return total


__all__ = ["Pipeline", "PipelineModel"]
