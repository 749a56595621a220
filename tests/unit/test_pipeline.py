"""Pipeline parallelism without a process group: stage layout arithmetic, the config errors, and stage
modules that together are the pp=1 model (same fqns, same initial weights, same forward)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.models import build_model, model_args_for
from trainer.parallel.build import split_stage_module
from trainer.parallel.pipeline import PipelineModel
from trainer.parallel.pipeline_layout import (
    balanced_split, bubble_fraction, cost_split, split_at, stage_ids, stage_module_fqns,
)
from trainer.validate import validate_job


def _cfg(*args: str):
    return load_job_config(["--config", DEBUG_CONFIG, *args])


# -- layout arithmetic -----------------------------------------------------------


@pytest.mark.parametrize(
    "n_layers, num_stages, weights, counts",
    [
        (4, 2, (1, 1), [2, 2]),  # 6 units: emb+2 | 2+head
        (4, 4, (1, 1), [1, 2, 1, 0]),  # 6 units over 4: 2,2,1,1; the last stage is norm+head only
        (4, 2, (0, 0), [2, 2]),
        (32, 4, (1, 1), [8, 9, 8, 7]),  # 34 units: 9,9,8,8
        (32, 4, (2, 3), [8, 9, 9, 6]),  # 37 units: 10,9,9,9
        (16, 8, (1, 1), [2, 3, 2, 2, 2, 2, 2, 1]),  # 18 units: 3,3,2,...,2
    ],
)
def test_equal_costs_split_as_evenly_as_layer_counts(n_layers, num_stages, weights, counts) -> None:
    got = cost_split([1.0] * n_layers, num_stages, embedding_cost=weights[0], head_cost=weights[1])
    assert got == counts
    units = list(got)
    units[0] += weights[0]
    units[-1] += weights[1]
    assert max(units) - min(units) <= 1  # balanced in layer-equivalents
    assert sum(got) == n_layers


def test_balanced_split_minimizes_the_largest_stage_against_brute_force() -> None:
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        n, groups = rng.randint(2, 9), rng.randint(1, 5)
        if groups > n:
            continue
        costs = [rng.choice([0.0, 0.5, 1.0, 2.5, 4.0]) for _ in range(n)]
        sizes = balanced_split(costs, groups)
        assert len(sizes) == groups and sum(sizes) == n and min(sizes) >= 1

        def sums(cuts):
            bounds = [0, *cuts, n]
            return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]

        best = min((max(sums(c)), sum(x * x for x in sums(c))) for c in itertools.combinations(range(1, n), groups - 1))
        got_sums = sums(list(itertools.accumulate(sizes))[:-1])
        assert (max(got_sums), sum(x * x for x in got_sums)) == pytest.approx(best)


def test_moe_blocks_weigh_by_their_active_parameters() -> None:
    # debug_moe: block 0 is dense (ffn 384), blocks 1-3 are MoE (top-2 of 64-wide experts + a 64-wide shared
    # expert + the router): the costs of trainer.models.pipeline_costs, which sum to flops_per_token.
    from trainer.models import flops_per_token, pipeline_costs

    args = model_args_for("debug_moe")
    embedding, blocks, head = pipeline_costs(args, 64)
    assert embedding == 0 and sum(blocks) + head == flops_per_token(args, 64)
    attn = 6 * (128 * 32 * (4 + 2 * 2) + 4 * 32 * 128) + 12 * 4 * 32 * 64
    assert blocks[0] == attn + 6 * (3 * 128 * args.ffn_dim + 2 * 128)
    assert blocks[1] == attn + 6 * (3 * 128 * 64 * (1 + 2) + 128 * 8 + 2 * 128)
    assert head == 6 * (128 + 128 * 512)
    # With 8B shapes the head costs about two blocks, so the last of 8 stages takes fewer blocks.
    e8, b8, h8 = pipeline_costs(model_args_for("8b"), 8192)
    assert 1.5 < h8 / b8[0] < 2.5
    assert cost_split(b8, 8, embedding_cost=e8, head_cost=h8)[-1] < 4


def test_stage_fqns_and_split_points() -> None:
    assert stage_module_fqns([2, 2]) == (
        ("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "output_head"))
    assert split_at(4, [1, 3]) == [1, 2, 1]
    assert stage_module_fqns(split_at(4, [0]))[0] == ("tok_embeddings",)
    # DeepSeek-V3's MTP modules (layers.4, layers.5 after 4 main blocks) and a copy of the embeddings: the last stage.
    assert stage_module_fqns([1, 2, 1], mtp_layers=2) == (
        ("tok_embeddings", "layers.0"), ("layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5", "tok_embeddings", "norm", "output_head"))


def test_stage_ids_loop_and_v() -> None:
    assert [stage_ids(r, 2, 2, v_style=False) for r in range(2)] == [(0,), (1,)]
    assert [stage_ids(r, 2, 4, v_style=False) for r in range(2)] == [(0, 2), (1, 3)]
    assert [stage_ids(r, 4, 8, v_style=True) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # Every stage runs on exactly one rank.
    for v in (False, True):
        ids = [s for r in range(4) for s in stage_ids(r, 4, 8, v_style=v)]
        assert sorted(ids) == list(range(8))


def test_bubble_fraction() -> None:
    assert bubble_fraction(pp=4, num_microbatches=8) == pytest.approx(3 / 11)
    assert bubble_fraction(pp=2, num_microbatches=4, stages_per_rank=2) == pytest.approx(0.5 / 4.5)


# -- validation: the resolved layout and the one-line errors --------------------------


def test_validate_resolves_the_pipeline() -> None:
    job = validate_job(_cfg("--distributed.pp=2", "--distributed.pipeline_schedule=Interleaved1F1B",
                            "--distributed.pp_microbatch_size=2"), world_size=4)
    p = job.pipeline
    assert (p.num_stages, p.stages_per_rank, p.num_microbatches, p.microbatch_size) == (4, 2, 4, 2)
    assert p.stage_fqns[0] == ("tok_embeddings", "layers.0")
    assert job.parallel_dims.pp == 2 and job.parallel_dims.dp_shard == 2
    assert not job.build.fsdp.reshard_after_forward  # no re-gather per microbatch under PP
    split = validate_job(_cfg("--distributed.pp=2", "--distributed.pp_split_points=layers.1"), world_size=2).pipeline
    assert split.stage_fqns == (("tok_embeddings", "layers.0"), ("layers.1", "layers.2", "layers.3", "norm",
                                                                  "output_head"))
    lps = validate_job(_cfg("--model.n_layers=6", "--distributed.pp=2", "--distributed.pp_layers_per_stage=2",
                            "--distributed.pipeline_schedule=ZBVZeroBubble"), world_size=2).pipeline
    assert (lps.num_stages, lps.stages_per_rank) == (4, 2)  # (6 blocks + embedding + head) / 2
    assert lps.stage_fqns[3] == ("layers.5", "norm", "output_head")
    assert validate_job(_cfg(), world_size=1).pipeline is None


@pytest.mark.parametrize(
    "args, schedule, stages, why",
    [
        ([], "Interleaved1F1B", 4, "auto: 2 stages per rank, half 1F1B's bubble"),  # 4 blocks, 8 microbatches
        (["--train.batch_size=6"], "Interleaved1F1B", 4, "auto: 2 stages per rank"),  # 3 rounds of 2
        (["--train.batch_size=5"], "1F1B", 2, "auto: 5 microbatches do not make Interleaved1F1B's rounds of pp=2"),
        (["--model.n_layers=3"], "1F1B", 2, "auto: 3 blocks cannot give each of 2 x pp=2 stages one"),
        (["--distributed.pp_stages_per_rank=1"], "1F1B", 2, "auto: one stage per rank from distributed.pp_stages_per_rank"),
        (["--distributed.pp_split_points=layers.2"], "1F1B", 2, "auto: one stage per rank from distributed.pp_split_points"),
        (["--model.n_layers=6", "--distributed.pp_layers_per_stage=2"], "Interleaved1F1B", 4,
         "auto: 2 stages per rank from distributed.pp_layers_per_stage"),
        (["--distributed.pipeline_schedule=1F1B"], "1F1B", 2, ""),  # named: taken as it is
    ],
)
def test_auto_schedule_is_interleaved_where_it_can_run(args: list[str], schedule: str, stages: int, why: str) -> None:
    """The default (auto) runs Interleaved1F1B, the faster schedule on 2x H200 (docs/distributed.md), wherever each
    of 2 x pp stages gets a block and torch's interleaved schedule takes the microbatch count; 1F1B otherwise, and
    the pp_* keys that fix the stage count decide it. The startup line carries why."""
    p = validate_job(_cfg("--distributed.pp=2", *args), world_size=2).pipeline
    assert (p.schedule, p.num_stages) == (schedule, stages)
    assert p.schedule_choice.startswith(why) and bool(p.schedule_choice) == bool(why)


@pytest.mark.parametrize(
    "world_size, args, message",
    [
        (3, ["--distributed.pp=2"], "distributed.pp=2 does not divide the world size 3"),
        (4, ["--distributed.pp=4", "--distributed.pipeline_schedule=Interleaved1F1B"],
         "distributed.pp: 8 pipeline stages but the model has only 4 blocks"),
        (2, ["--distributed.pp=2", "--distributed.pp_stages_per_rank=4", "--distributed.pipeline_schedule=Interleaved1F1B"],
         "distributed.pp_stages_per_rank: 8 pipeline stages but the model has only 4 blocks"),
        (2, ["--distributed.pp=2", "--distributed.pp_microbatch_size=3"],
         "distributed.pp_microbatch_size=3 does not divide train.batch_size=8"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=LoopedBFS"],
         "distributed.pipeline_schedule='LoopedBFS' is not one of 'auto', 'GPipe', '1F1B', 'Interleaved1F1B'"),
        (2, ["--distributed.pp=2", "--distributed.pp_split_points=layers.9"],
         "distributed.pp_split_points entry 'layers.9' names no module"),
        (2, ["--distributed.pp=2", "--distributed.pp_split_points=norm"],
         "distributed.pp_split_points entry 'norm' names no module"),
        (2, ["--distributed.pp=2", "--distributed.pp_split_points=layers.3,layers.1"],
         "must be in increasing block order"),
        (2, ["--distributed.pp=2", "--distributed.pp_split_points=layers.1,layers.2"],
         "distributed.pp_split_points gives 3 pipeline stages, not a multiple of distributed.pp=2"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=1F1B", "--distributed.pp_stages_per_rank=2"],
         "distributed.pipeline_schedule='1F1B' runs one stage per rank"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=1F1B", "--train.batch_size=1"],
         "distributed.pipeline_schedule='1F1B' needs at least pp=2 microbatches, but train.batch_size=1 / "
         "distributed.pp_microbatch_size=1 gives 1"),
        (2, ["--distributed.pp=2", "--train.batch_size=2", "--distributed.pp_microbatch_size=2"],
         "distributed.pipeline_schedule='auto' (1F1B here) needs at least pp=2 microbatches"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=Interleaved1F1B", "--train.batch_size=5"],
         "distributed.pipeline_schedule='Interleaved1F1B' runs the microbatches in 2 rounds of about pp=2, but "
         "train.batch_size=5 / distributed.pp_microbatch_size=1 gives 5, not a multiple of 2"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=Interleaved1F1B", "--distributed.pp_stages_per_rank=1"],
         "distributed.pipeline_schedule='Interleaved1F1B' needs at least 2 stages per rank"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=ZBVZeroBubble", "--distributed.pp_stages_per_rank=3"],
         "distributed.pipeline_schedule='ZBVZeroBubble' runs exactly 2 stages per rank (a V)"),
        (2, ["--distributed.pp=2", "--distributed.pp_layers_per_stage=2"],
         "distributed.pp_layers_per_stage gives 3 pipeline stages, not a multiple of distributed.pp=2"),
        (1, ["--model.n_layers=8", "--distributed.pp=1", "--distributed.pp_split_points=layers.4"],
         "distributed.pp_split_points=['layers.4'] is set but distributed.pp=1"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=ZBVZeroBubble", "--train.compile_model=true"],
         "distributed.pipeline_schedule='ZBVZeroBubble' with train.compile_model=true"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=InterleavedZeroBubble",
             "--train.activation_checkpointing=selective"],
         "distributed.pipeline_schedule='InterleavedZeroBubble' with train.activation_checkpointing='selective'"),
    ],
)
def test_bad_pipeline_config_is_one_line_naming_the_key(world_size: int, args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate_job(_cfg(*args), world_size=world_size)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_zero_bubble_schedules_refused_before_torch_2_13(schedule: str, monkeypatch) -> None:
    """torch 2.11's weight-gradient pass failed at the first step on 2x H200 (ZBV, eager, fp32 debug model too): a
    torch older than 2.13 is refused in one line before the run, the schedule and the way out named."""
    import trainer.validate.layout as layout

    monkeypatch.setattr(layout, "torch_version", lambda: (2, 11))
    with pytest.raises(ConfigError) as e:
        validate_job(_cfg("--distributed.pp=2", f"--distributed.pipeline_schedule={schedule}"), world_size=2)
    assert f"distributed.pipeline_schedule='{schedule}' needs torch >= 2.13" in str(e.value)
    assert "use 'Interleaved1F1B'" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(layout, "torch_version", lambda: (2, 13))
    validate_job(_cfg("--distributed.pp=2", f"--distributed.pipeline_schedule={schedule}"), world_size=2)


# -- stage modules are the pp=1 model -------------------------------------------------


@pytest.mark.parametrize("arg, message", [
    ("--distributed.pp_microbatch_size=0", "distributed.pp_microbatch_size=0 must be >= 1"),
    ("--distributed.pp_stages_per_rank=-1", "distributed.pp_stages_per_rank=-1 must be >= 0 (0 = automatic)"),
    ("--distributed.pp_head_weight=-2", "distributed.pp_head_weight=-2.0 must be >= 0 (a cost in blocks), or -1"),
])
def test_pipeline_key_ranges_fail_while_parsing(arg: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg(arg)


def _stages(fqns_per_stage, args, *, seed: int) -> list[torch.nn.Module]:
    parts = []
    for fqns in fqns_per_stage:
        with torch.device("meta"):
            part = split_stage_module(build_model(args), fqns)  # the pp=1 builder, any family
        part.to_empty(device="cpu")
        part.init_weights(seed=seed)
        parts.append(part)
    return parts


@pytest.mark.parametrize("flavor", ["debug", "debug_moe"])
@pytest.mark.parametrize("counts", [[2, 2], [1, 2, 1, 0], [0, 4]])
def test_stages_together_are_the_full_model(counts: list[int], flavor: str) -> None:
    args = model_args_for(flavor, max_seq_len=32)
    full = build_model(args)
    full.init_weights(seed=3)
    parts = _stages(stage_module_fqns(counts), args, seed=3)
    # Same fqns, each in exactly one stage, with the pp=1 initial values.
    full_sd = full.state_dict()
    keys = [k for p in parts for k in p.state_dict()]
    assert sorted(keys) == sorted(full_sd) and len(keys) == len(set(keys))
    for part in parts:
        for k, v in part.state_dict().items():
            assert torch.equal(v, full_sd[k]), k
    # The container of a rank's stages (here: all of them) has the full model's state-dict keys.
    assert list(PipelineModel(parts).state_dict()) == list(full_sd)
    # Chained, the stages compute the full model's hidden states.
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)
