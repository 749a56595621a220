"""The pipeline's layout: pure arithmetic on stages, blocks and ranks (the runtime is trainer/parallel/pipeline.py).

trainer.validate resolves a `PipelineOptions` from the config with these functions, turning an impossible
layout into a ConfigError first; the runtime builds and schedules the stages it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble",)
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
INTERLEAVED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")  # microbatches in rounds of pp
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
    schedule_choice: str = ""
    """Why distributed.pipeline_schedule='auto' chose `schedule` ("" when the config named it), for the startup log."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_fqns)

    @property
    def v_style(self) -> bool:
        return self.schedule in V_SCHEDULES


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


def stage_module_fqns(layer_counts: list[int], *, mtp_layers: int = 0) -> tuple[tuple[str, ...], ...]:
    """Top-level module fqns of each stage, from its block count: embedding first, norm and head last. With
    DeepSeek-V3's MTP modules (`layers.{n_layers + k}`), the last stage holds them after its blocks, and a copy of the
    embeddings for their tokens ahead (trainer.parallel.pipeline sums its gradient with the first stage's)."""
    stages, start, n_layers = [], 0, sum(layer_counts)
    for i, count in enumerate(layer_counts):
        fqns = [EMBEDDING] if i == 0 else []
        fqns += [f"layers.{j}" for j in range(start, start + count)]
        if i == len(layer_counts) - 1:
            fqns += [f"layers.{n_layers + k}" for k in range(mtp_layers)] + [EMBEDDING] * bool(mtp_layers)
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


__all__ = [
    "EMBEDDING", "HEAD", "INTERLEAVED_SCHEDULES", "SCHEDULES", "SINGLE_STAGE_SCHEDULES", "V_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "PipelineOptions", "balanced_split", "bubble_fraction", "cost_split", "default_stages_per_rank",
    "describe_split", "parse_split_point", "split_at", "stage_ids", "stage_module_fqns",
]
