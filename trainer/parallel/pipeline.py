"""Pipeline parallelism with torch.distributed.pipelining: stage layout, stage modules, schedule, step.

The model is split by fqn. Every stage module is a whole `Llama` built on the meta
device with the blocks of other stages deleted and, off the edge stages, the
embedding, final norm and output head set to None (the torchtitan way), so every
parameter keeps the fqn it has in the full model: FP8 filters, the TP plan,
checkpoints (DCP reshards by fqn) and the HF export see the same names at any pp.
Each stage then gets the same `build_parallel_model` (TP -> FP8 -> AC -> compile ->
FSDP2) as a pp=1 model, and fills its weights with the per-fqn seeded init, so the
stages together start from exactly the pp=1 weights.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

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


def even_split(n_layers: int, num_stages: int, *, embedding_weight: int, head_weight: int) -> list[int]:
    """Blocks per stage for an even split of n_layers + embedding_weight + head_weight layer-equivalents.

    Stages get floor(total / num_stages) units, the first (total mod num_stages) one
    more; the embedding's units come out of stage 0's share and the head's out of the
    last stage's. Raises ValueError when a stage would be empty or an edge stage
    cannot hold its embedding/head weight.
    """
    total = n_layers + embedding_weight + head_weight
    if num_stages > total:
        raise ValueError(f"{num_stages} stages for {total} layer-equivalents")
    base, extra = divmod(total, num_stages)
    units = [base + (i < extra) for i in range(num_stages)]
    counts = list(units)
    counts[0] -= embedding_weight
    counts[-1] -= head_weight
    if counts[0] < 0 or counts[-1] < 0:
        raise ValueError(f"an edge stage gets {min(counts[0], counts[-1])} blocks")
    assert sum(counts) == n_layers, (counts, n_layers)
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
    """Keep only `fqns` of a (meta) Llama, in place: other blocks deleted, embedding/norm/head set to None."""
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
    from trainer.parallel.float8 import _matches

    linears = [fqn for fqn, m in part.named_modules() if isinstance(m, nn.Linear)]
    return tuple(e for e in exclude_fqns if any(_matches(fqn, e) for fqn in linears))


def _merge_float8_reports(reports: list):
    reports = [r for r in reports if r is not None]
    if not reports:
        return None
    merged = dataclasses.replace(reports[0], converted=[], excluded={}, num_linear=0)
    for r in reports:
        merged.converted += r.converted
        merged.excluded.update(r.excluded)
        merged.num_linear += r.num_linear
    return merged


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32, as `Llama.head_loss` computes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Pipeline:
    """This rank's stages, their schedule, and the forward/backward of one optimizer step."""

    def __init__(self, model_args, parallel_dims, *, options: PipelineOptions, build, device: torch.device,
                 seed: int, grad_accum_steps: int):
        from torch.distributed.pipelining import PipelineStage

        from trainer.models import Llama
        from trainer.parallel.build import build_parallel_model

        self.options = options
        self.device = device
        pp_mesh = parallel_dims.mesh("pp")
        self.pp_group = pp_mesh.get_group()
        pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
        self.stage_ids = stage_ids(pp_rank, pp, options.num_stages, v_style=options.v_style)
        # The loss of one schedule microbatch is divided by every microbatch of the optimizer
        # step (pipeline microbatches x grad_accum_steps): the step's gradient is the gradient
        # of the mean loss over the global batch, exactly as at pp=1.
        self.grad_accum_steps = grad_accum_steps
        self._loss_factor: torch.Tensor | float = 1.0
        # Compiled (as the pp=1 head with its loss is), the upcast of the logits fuses into the
        # cross-entropy instead of materializing fp32 logits; eager under TP's loss parallel, as at pp=1.
        self._cross_entropy = (torch.compile(cross_entropy, fullgraph=True)
                               if build.compile and parallel_dims.tp == 1 else cross_entropy)

        parts, stages, reports = [], [], []
        for sid in self.stage_ids:
            fqns = options.stage_fqns[sid]
            with torch.device("meta"):
                part = split_stage_module(Llama(model_args), fqns)
            opts = build
            if build.float8 is not None:
                opts = dataclasses.replace(build, float8=dataclasses.replace(
                    build.float8, exclude_fqns=_stage_float8_excludes(part, build.float8.exclude_fqns)))
            reports.append(build_parallel_model(part, parallel_dims, options=opts, device=device))
            # Materialize this rank's shards and fill them with the per-fqn seeded init: the
            # same values as the pp=1 model's (trainer.models.llama.Llama.init_weights).
            part.to_empty(device=device)
            part.init_weights(seed=seed)
            part.train()
            parts.append(part)
            stages.append(PipelineStage(part, sid, options.num_stages, device, group=self.pp_group))
            blocks = [f for f in fqns if f.startswith("layers.")]
            edges = [f for f in fqns if not f.startswith("layers.")]
            logger.info("pipeline stage %d/%d on pp rank %d: %s%s", sid, options.num_stages, pp_rank,
                        f"{blocks[0]}..{blocks[-1]} ({len(blocks)} blocks)" if blocks else "no blocks",
                        f" + {', '.join(edges)}" if edges else "")
        self.parts = parts
        self.stages = stages
        self.model = PipelineModel(parts)
        self.float8_report = _merge_float8_reports(reports)
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

        cls = _schedule_class(options.schedule)
        single = options.schedule in SINGLE_STAGE_SCHEDULES
        self.schedule = cls(stages[0] if single else stages, n_microbatches=options.num_microbatches,
                            loss_fn=self._loss, scale_grads=False)
        # return_outputs=False keeps the last stage from concatenating every microbatch's logits
        # (batch x seq x vocab) after the step; older torch has no such argument and always returns them.
        self._step_kwargs = (
            {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        )
        logger.info(
            "pipeline: schedule=%s, %d stages (%d per rank), %d microbatches of %d sequences; "
            "bubble ~%.0f%% of the step", options.schedule, options.num_stages, options.stages_per_rank,
            options.num_microbatches, options.microbatch_size,
            100 * bubble_fraction(pp=pp, num_microbatches=options.num_microbatches,
                                  stages_per_rank=options.stages_per_rank),
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The schedule calls this on the last stage for every microbatch and backpropagates it.
        return self._cross_entropy(logits, labels) * self._loss_factor

    def forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]], *,
                         loss_scale: torch.Tensor | None, loss_context=contextlib.nullcontext) -> torch.Tensor:
        """Run the schedule over each batch of the optimizer step; gradients accumulate in the parameters.

        loss_context: entered around each schedule step, i.e. around the loss's forward and
        backward (TP's loss_parallel, for logits sharded over the vocabulary). Returns the
        step's mean loss on every pp rank (sent from the last stage by a sum over the pp
        group, where only the last stage's ranks hold a non-zero loss).
        """
        assert len(microbatches) == self.grad_accum_steps, (len(microbatches), self.grad_accum_steps)
        n = self.options.num_microbatches * self.grad_accum_steps
        scale = loss_scale if loss_scale is not None else 1.0
        self._loss_factor = scale / n
        total = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            with loss_context():
                total += self._run_schedule(self.schedule.step, inputs, labels)
        if loss_scale is not None:
            total = total / loss_scale
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pp_group)
        return total

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss of one batch through the schedule, forward only (`schedule.eval`), on every pp rank.

        The same microbatches as a training step of this batch; the last stage's mean is sent to
        the other pp ranks by a sum over the pp group (only the last stage's ranks hold a loss).
        """
        self._loss_factor = 1.0 / self.options.num_microbatches
        total = self._run_schedule(self.schedule.eval, inputs, labels)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pp_group)
        return total

    def _run_schedule(self, run, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One schedule call (`step` or `eval`) on one batch; the sum of this rank's last-stage microbatch
        losses (each already times `_loss_factor`), zero on ranks without the last stage."""
        args = (inputs.to(self.device, non_blocking=True),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels.to(self.device, non_blocking=True), "losses": losses} if self.has_last else {}
        run(*args, **kwargs, **self._step_kwargs)
        if not losses:
            return torch.zeros((), device=self.device)
        # Replicated DTensors under loss parallel: every TP rank holds the whole loss.
        return torch.stack([(x.to_local() if isinstance(x, DTensor) else x).detach() for x in losses]).sum()


__all__ = [
    "Pipeline", "PipelineModel", "PipelineOptions", "SCHEDULES", "bubble_fraction", "default_stages_per_rank",
    "even_split", "split_at", "stage_ids", "stage_module_fqns",
]
