"""Pipeline parallelism with torch.distributed.pipelining: stage layout, stage modules, schedule, step.

The model is split by fqn. Every stage module is the whole model, built on the meta
device by the same builder as at pp=1 (`trainer.models.build_model`, any family), with
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
import dataclasses
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.log import info_silenced

logger = logging.getLogger(__name__)

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble",)
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
EMBEDDING, HEAD = "tok_embeddings", ("norm", "output_head")
_LAYER = re.compile(r"^layers\.(\d+)$")


@dataclass(frozen=True)
class PipelineOptions:
    """The resolved pipeline: made once from the validated config by trainer.validate."""

    schedule: str
    microbatch_size: int
    num_microbatches: int
    """Pipeline microbatches per train.batch_size batch (per schedule step)."""
    stages_per_rank: int
    stage_fqns: tuple[tuple[str, ...], ...]
    """Top-level module fqns of every stage in model order: tok_embeddings, layers.N, norm, output_head."""
    stage_costs: tuple[float, ...] = ()
    """Each stage's share of the model's training FLOPs per token (trainer.models.pipeline_costs)."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_fqns)

    @property
    def v_style(self) -> bool:
        return self.schedule in V_SCHEDULES


# ---------------------------------------------------------------------------
# Layout: pure arithmetic (trainer.validate turns impossible layouts into ConfigErrors first)


def default_stages_per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def balanced_split(costs: list[float], num_groups: int) -> list[int]:
    """Sizes of `num_groups` non-empty contiguous groups of `costs` (in order): the largest group sum as small as
    possible, then the sum of squared group sums (the groups as even as possible); on a tie the earlier groups
    take more. Dynamic programming over (groups, items covered): O(num_groups x len(costs)^2), once per job."""
    n = len(costs)
    assert 1 <= num_groups <= n, (num_groups, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[g][i]: (largest sum, sum of squares) of the best split of costs[:i] into g groups, and its last cut.
    best: list[dict[int, tuple[tuple[float, float], int]]] = [{0: ((0.0, 0.0), 0)}]
    for g in range(1, num_groups + 1):
        row = {}
        for i in range(g, n - (num_groups - g) + 1):
            choice = None
            for j in range(i - 1, g - 2, -1):  # larger j first: a later cut keeps earlier groups larger on ties
                if j not in best[g - 1]:
                    continue
                (worst, squares), _ = best[g - 1][j]
                part = prefix[i] - prefix[j]
                score = (max(worst, part), squares + part * part)
                if choice is None or score < choice[0]:
                    choice = (score, j)
            row[i] = choice
        best.append(row)
    sizes, i = [], n
    for g in range(num_groups, 0, -1):
        j = best[g][i][1]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def cost_split(block_costs: list[float], num_stages: int, *, embedding_cost: float, head_cost: float) -> list[int]:
    """Blocks per stage that balance the stages' costs; the embedding's cost falls on the first stage and the
    final norm + head's on the last. A stage holds at least one piece (a block, or the embedding or the head)."""
    sizes = balanced_split([embedding_cost, *block_costs, head_cost], num_stages)
    counts = list(sizes)
    counts[0] -= 1  # the embedding
    counts[-1] -= 1  # the final norm and head
    return counts


def split_at(n_layers: int, first_blocks: list[int]) -> list[int]:
    """Blocks per stage when stage i+1 starts at block first_blocks[i] (strictly increasing, in 0..n_layers-1)."""
    bounds = [0, *first_blocks, n_layers]
    assert all(a < b for a, b in zip(bounds[1:], bounds[2:])) and bounds[1] >= 0, (first_blocks, n_layers)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def parse_split_point(entry: str) -> int | None:
    """The block index of a split point "layers.N", or None when the entry is not of that form."""
    m = _LAYER.match(entry)
    return int(m.group(1)) if m else None


def stage_module_fqns(layer_counts: list[int]) -> tuple[tuple[str, ...], ...]:
    """Top-level module fqns of each stage, from its block count: embedding first, norm and head last."""
    stages, start = [], 0
    for i, count in enumerate(layer_counts):
        fqns = [EMBEDDING] if i == 0 else []
        fqns += [f"layers.{j}" for j in range(start, start + count)]
        if i == len(layer_counts) - 1:
            fqns += list(HEAD)
        stages.append(tuple(fqns))
        start += count
    return tuple(stages)


def stage_ids(pp_rank: int, pp: int, num_stages: int, *, v_style: bool) -> tuple[int, ...]:
    """The stages pipeline rank pp_rank runs (loop: r, r+pp, ...; V: r and num_stages-1-r)."""
    assert num_stages % pp == 0, (num_stages, pp)
    per_rank = num_stages // pp
    if v_style:
        assert per_rank == 2, per_rank
        return (pp_rank, num_stages - 1 - pp_rank)
    return tuple(pp_rank + s * pp for s in range(per_rank))


def bubble_fraction(*, pp: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a 1F1B/GPipe step, (p-1)/(m+p-1); interleaving with v stages per rank divides the bubble by v."""
    idle = (pp - 1) / stages_per_rank
    return idle / (num_microbatches + idle)


# ---------------------------------------------------------------------------
# Stage modules and the container the optimizer and checkpoints see


def split_stage_module(model: nn.Module, fqns: tuple[str, ...]) -> nn.Module:
    """Keep only `fqns` of a (meta) model, in place: other blocks deleted, embedding/norm/head set to None."""
    keep = set(fqns)
    for name in list(model.layers.keys()):
        if f"layers.{name}" not in keep:
            del model.layers[name]
    for name in (EMBEDDING, *HEAD):
        if name not in keep:
            setattr(model, name, None)
    return model


class PipelineModel(nn.Module):
    """This rank's stage modules as one module whose parameter fqns are the full model's.

    The optimizer and the checkpoint see this: `state_dict()` keys are the original
    fqns (`layers.2.attention.q_proj.weight`), so DCP reshards between any pp layouts.
    The modules are shared with the stages, not copied. It has no forward: the
    pipeline schedule runs the stages.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        first = next((p for p in parts if p.tok_embeddings is not None), None)
        last = next((p for p in parts if p.output_head is not None), None)
        self.tok_embeddings = first.tok_embeddings if first is not None else None
        blocks = {name: block for p in parts for name, block in p.layers.items()}
        self.layers = nn.ModuleDict({name: blocks[name] for name in sorted(blocks, key=int)})
        self.norm = last.norm if last is not None else None
        self.output_head = last.output_head if last is not None else None
        self.cp = parts[0].cp  # every stage's: the same chunk layout

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineModel has no forward: run the pipeline schedule (Pipeline.forward_backward)")


# ---------------------------------------------------------------------------
# The pipeline: stages, schedule and the forward/backward of one optimizer step


def _schedule_class(name: str):
    from torch.distributed.pipelining import schedules

    return {
        "GPipe": schedules.ScheduleGPipe,
        "1F1B": schedules.Schedule1F1B,
        "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
        "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
        "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
    }[name]


def _stage_float8_excludes(part: nn.Module, exclude_fqns: tuple[str, ...]) -> tuple[str, ...]:
    """The float8.exclude_fqns entries that match a Linear of this stage (validate checked each matches one
    somewhere in the full model; an entry for another stage's layer is not an error here)."""
    from trainer.parallel.float8 import matches_exclusion

    linears = [fqn for fqn, m in part.named_modules() if isinstance(m, nn.Linear)]
    return tuple(e for e in exclude_fqns if any(matches_exclusion(fqn, e) for fqn in linears))


def describe_split(stage_fqns, costs, own: list[int], pp_rank: int) -> str:
    """One line for the whole split, e.g. `pipeline split: 0 tok_embeddings+layers.0 23% | 1 layers.1-2 40%
    | ...; pp rank 0 runs stages 0, 2`."""
    stages = []
    for sid, fqns in enumerate(stage_fqns):
        blocks = [int(f.split(".")[1]) for f in fqns if f.startswith("layers.")]
        names = [f for f in fqns if not f.startswith("layers.")]
        if blocks:
            span = f"layers.{blocks[0]}" if len(blocks) == 1 else f"layers.{blocks[0]}-{blocks[-1]}"
            names.insert(1 if fqns[0] == "tok_embeddings" else 0, span)
        share = f" {100 * costs[sid]:.0f}%" if costs else ""
        stages.append(f"{sid} {'+'.join(names) or 'empty'}{share}")
    return (f"pipeline split ({'share of the FLOPs' if costs else 'stage: modules'}): " + " | ".join(stages)
            + f"; pp rank {pp_rank} runs stage{'s' if len(own) > 1 else ''} {', '.join(map(str, own))}")


class Pipeline:
    """This rank's stages, their schedule, and the forward/backward of one optimizer step."""

    def __init__(self, model_args, parallel_dims, *, options: PipelineOptions, build, device: torch.device,
                 seed: int, seq_len: int,
                 build_loss: Callable[[nn.Module], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]):
        """build_loss(last stage module) -> loss_fn(hidden states, labels): the trainer's loss function."""
        from trainer.models import build_model
        from trainer.parallel.build import build_parallel_model

        self.options = options
        self.device = device
        pp_mesh = parallel_dims.mesh("pp")
        self.pp_group = pp_mesh.get_group()
        self.pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
        self.stage_ids = stage_ids(self.pp_rank, pp, options.num_stages, v_style=options.v_style)
        # What the schedule's loss is multiplied by before its backward (set per step by the caller:
        # loss scale / every microbatch of the optimizer step).
        self._loss_factor: torch.Tensor | float = 1.0

        parts, reports = [], []
        for sid in self.stage_ids:
            with torch.device("meta"):
                part = split_stage_module(build_model(model_args), options.stage_fqns[sid])
            opts = build
            if build.float8 is not None:
                opts = dataclasses.replace(build, float8=dataclasses.replace(
                    build.float8, exclude_fqns=_stage_float8_excludes(part, build.float8.exclude_fqns)))
            # The first stage's build lines say how every stage is built; the others' would repeat them.
            if not parts:
                logger.info("pipeline stage %d/%d first (this rank's others are built alike, the split follows):",
                            sid, options.num_stages)
            with info_silenced() if parts else contextlib.nullcontext():
                reports.append(build_parallel_model(part, parallel_dims, options=opts, device=device))
            # Materialize this rank's shards and fill them with the per-fqn seeded init: the
            # same values as the pp=1 model's (trainer.models.layers.Decoder.init_weights).
            part.to_empty(device=device)
            part.init_weights(seed=seed)
            part.train()
            parts.append(part)
        logger.info(describe_split(options.stage_fqns, options.stage_costs, self.stage_ids, self.pp_rank))
        self.parts = parts
        self.model = PipelineModel(parts)
        self.float8_report = self._gather_float8_reports(reports)
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
        self.has_first = any(s.is_first for s in self._stages)
        self.has_last = any(s.is_last for s in self._stages)

    def _gather_float8_reports(self, reports: list):
        """Every stage's FP8 report, from every pp rank, merged: the whole model's, which rank 0 logs in one
        line and which feeds the metrics and fp8_layers.json. None when the run is not fp8."""
        from trainer.parallel.float8 import merge_reports

        if all(r is None for r in reports):
            return None
        gathered: list = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, list(zip(self.stage_ids, reports)), group=self.pp_group)
        by_stage = sorted((sid, report) for part in gathered for sid, report in part)
        merged = merge_reports([report for _, report in by_stage])
        if merged is not None:
            per_stage = ", ".join(f"{len(r.converted)}/{r.num_linear}" for _, r in by_stage)
            logger.info("FP8 over all %d pipeline stages (%s converted on stages 0..%d): %s",
                        self.options.num_stages, per_stage, self.options.num_stages - 1, merged.lines()[1])
            if merged.experts is not None:  # the first stage's line counted its own MoE layers only
                logger.info("FP8 over all %d pipeline stages: %s", self.options.num_stages, merged.experts.line())
        return merged

    @property
    def num_microbatches(self) -> int:
        return self.options.num_microbatches

    def _build_schedule(self, parts: list[nn.Module]):
        from torch.distributed.pipelining import PipelineStage

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
            "pipeline: schedule=%s, %d stages (%d per rank), %d microbatches of %d sequences; "
            "bubble ~%.0f%% of the step", o.schedule, o.num_stages, o.stages_per_rank, o.num_microbatches,
            o.microbatch_size,
            100 * bubble_fraction(pp=pp, num_microbatches=o.num_microbatches, stages_per_rank=o.stages_per_rank),
        )
        return schedule

    def _loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The schedule calls this on the last stage for every microbatch and backpropagates what it returns
        # (torch may also call it once on placeholder outputs, e.g. while inferring shapes: the step's losses
        # are the ones the schedule hands back).
        return self.loss_fn(h, labels) * self._loss_factor

    def forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]], *,
                         loss_factor: torch.Tensor | float, loss_context=contextlib.nullcontext) -> torch.Tensor:
        """Run the schedule over each batch of the optimizer step; gradients accumulate in the parameters.

        loss_factor: what each microbatch's loss is multiplied by before its backward (loss scale /
        every microbatch of the step). loss_context: entered around each schedule step, i.e. around
        the loss's forward and backward (TP's loss_parallel, for logits sharded over the vocabulary).
        Returns the step's mean loss on every pp rank (sent from the last stage by a sum over the pp
        group, where only the last stage's ranks hold a non-zero loss).
        """
        self._loss_factor = loss_factor
        losses: list[torch.Tensor] = []
        for inputs, labels in microbatches:
            with loss_context():
                losses += self._run_schedule(self.schedule.step, inputs, labels)
        return self._mean_loss(losses, factor=loss_factor)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss of one batch through the schedule, forward only (`schedule.eval`), on every pp rank.

        The same microbatches as a training step of this batch.
        """
        self._loss_factor = 1.0
        return self._mean_loss(self._run_schedule(self.schedule.eval, inputs, labels), factor=1.0)

    def _run_schedule(self, run, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One schedule call (`step` or `eval`) on one batch: the last stage's microbatch losses (each times
        `_loss_factor`, detached), none on ranks without the last stage."""
        args = (inputs.to(self.device, non_blocking=True),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels.to(self.device, non_blocking=True), "losses": losses} if self.has_last else {}
        run(*args, **kwargs, **self._step_kwargs)
        # Replicated DTensors under loss parallel: every TP rank holds the whole loss.
        return [(x.to_local() if isinstance(x, DTensor) else x).detach() for x in losses]

    def _mean_loss(self, losses: list[torch.Tensor], *, factor: torch.Tensor | float) -> torch.Tensor:
        """The mean unscaled microbatch loss on every pp rank: sent from the last stage by a sum over the pp
        group, where only the last stage's ranks hold losses."""
        total = torch.stack(losses).sum() / (factor * len(losses)) if losses else torch.zeros((), device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pp_group)
        return total


__all__ = [
    "Pipeline", "PipelineModel", "PipelineOptions", "SCHEDULES", "balanced_split", "bubble_fraction", "cost_split",
    "default_stages_per_rank", "split_at", "stage_ids", "stage_module_fqns",
]
