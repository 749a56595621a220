"""The parallel layout: degrees against the world size and the model's shapes, and the pipeline's stages.

Each check raises `ConfigError` with one line naming the key; nothing here needs a process
group, so `trainer.validate.validate_job` runs it on every rank before any is created.
"""

from __future__ import annotations

import logging
import math

import torch

from trainer.config import GptOssSection, JobConfig, MoESection
from trainer.errors import ConfigError
from trainer.hf import ExportError, check_exportable
from trainer.model_values import GptOssArgs
from trainer.models import ModelArgs, family_of, pipeline_costs
from trainer.parallel import ParallelDims
from trainer.parallel.pipeline_layout import (
    INTERLEAVED_SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, PipelineOptions, cost_split,
    default_stages_per_rank, parse_split_point, split_at, stage_module_fqns,
)
from trainer.validate.deepseek_v3 import check_deepseek_v3
from trainer.validate.resolve import experts_outside_fsdp

logger = logging.getLogger(__name__)

ZERO_BUBBLE_MIN_TORCH = (2, 13)
"""torch 2.11's zero-bubble weight-gradient pass (pipelining/_backward.py's stage_backward_weight) failed at its first
W action on 2x H200, eager and fp32 too (2026-11-28: `'_input_metadata' is invalid for this instance of
_C._FunctionBase`); torch 2.13's rewritten one passes the CPU tests (tests/distributed/test_pipeline.py)."""


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def resolve_parallel_dims(cfg: JobConfig, *, world_size: int) -> ParallelDims:
    d = cfg.distributed
    if d.pp > 1 and world_size % d.pp:
        raise ConfigError(f"distributed.pp={d.pp} does not divide the world size {world_size}")
    seq_len = cfg.train.seq_len
    if d.cp > 1 and seq_len % (2 * d.cp):
        raise ConfigError(
            f"train.seq_len={seq_len} with distributed.cp={d.cp}: each sequence is cut into 2 x cp = {2 * d.cp} chunks "
            f"of equal length, so seq_len must be a multiple of {2 * d.cp}"
        )
    return ParallelDims.resolve(
        dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, tp=d.tp, ep=d.ep, pp=d.pp, world_size=world_size, cp=d.cp
    )


def check_reduce_dtype(cfg: JobConfig, pd: ParallelDims) -> None:
    """distributed.reduce_dtype='fp8' replaces FSDP2's reduce-scatter (trainer.parallel.fp8_reduce): it needs one
    that sums more than one rank. FSDP2 reduce-scatters over dp_shard x cp; HSDP's replicas all-reduce, not in fp8."""
    d = cfg.distributed
    if d.reduce_dtype == "fp8" and pd.fsdp_shard == 1:
        replicas = f", and the {pd.dp_replicate} HSDP replicas all-reduce in the master dtype" * (pd.dp_replicate > 1)
        raise ConfigError(
            f"distributed.reduce_dtype='fp8' reduce-scatters gradients in float8 over FSDP's shard group, but it has "
            f"one rank (distributed.dp_shard x distributed.cp = {pd.dp_shard} x {pd.cp}, world size {pd.world_size})"
            f"{replicas}: no reduce-scatter sums anything; set distributed.reduce_dtype='auto' or shard over more ranks"
        )


def check_model_layout(cfg: JobConfig, args: ModelArgs, pd: ParallelDims) -> None:
    """What the model's shapes and family allow of the resolved degrees."""
    m = cfg.model
    if args.n_heads % pd.tp or args.n_kv_heads % pd.tp:
        raise ConfigError(
            f"distributed.tp={pd.tp} must divide the model's n_heads={args.n_heads} and n_kv_heads={args.n_kv_heads} "
            f"(model.flavor={m.flavor!r})"
        )
    if args.tie_word_embeddings and (pd.pp > 1 or pd.tp > 1):
        # PP: the embeddings and the head are on different stages. TP: the embeddings' and the head's plans would
        # each distribute the one weight.
        key, degree = ("pp", pd.pp) if pd.pp > 1 else ("tp", pd.tp)
        raise ConfigError(f"model.tie_word_embeddings=true with distributed.{key}={degree}: a tied table is one "
                          f"weight, which {'pipeline' if key == 'pp' else 'tensor'} parallel would split in two; set "
                          f"distributed.{key}=1 (tied models are small: FSDP alone shards them) or "
                          "model.tie_word_embeddings=false")
    if args.tie_word_embeddings and cfg.train.loss_chunk_tokens:
        raise ConfigError(f"model.tie_word_embeddings=true with train.loss_chunk_tokens={cfg.train.loss_chunk_tokens} "
                          "is not supported yet: each chunk's recompute in backward ran the tied head with its "
                          "FSDP2 unit already resharded (an H100 run failed); set train.loss_chunk_tokens=0")
    _check_moe_layout(cfg, args, pd)
    check_deepseek_v3(cfg, args, pd)
    _check_exports(cfg, args)
    if isinstance(args, GptOssArgs):
        _check_gpt_oss_layout(cfg, args)
    elif changed := [f for f in GptOssSection.__dataclass_fields__ if getattr(cfg.gpt_oss, f) is not None]:
        raise ConfigError(f"gpt_oss.{changed[0]}={getattr(cfg.gpt_oss, changed[0])} has no effect: "
                          f"model.flavor={cfg.model.flavor!r} is not GPT-OSS; remove it or pick a GPT-OSS flavor "
                          "(debug_gpt_oss, gpt_oss_20b)")


def _check_exports(cfg: JobConfig, args: ModelArgs) -> None:
    """An export (checkpoint.model_only's at the end, export_interval's during training) of a model without an exact
    Hugging Face target (routing, tied tables some layouts have no place for) is refused before training."""
    c, asked = cfg.checkpoint, {}  # each key that asks for an export: its setting, and the one that turns it off
    if c.model_only:
        asked["checkpoint.model_only=true"] = "checkpoint.model_only=false"
    if c.export_interval:
        asked[f"checkpoint.export_interval={c.export_interval}"] = "checkpoint.export_interval=0"
    if not asked:
        return
    try:
        check_exportable(args)
    except ExportError as e:
        raise ConfigError(f"{', '.join(asked)}: {e}; set {' and '.join(asked.values())}") from None


def _check_gpt_oss_layout(cfg: JobConfig, args: GptOssArgs) -> None:
    """What GPT-OSS (trainer/models/gpt_oss.py) does not run yet, each refused in one line: every parallelism runs it
    (tests/distributed/test_moe_ep.py, test_moe_layouts.py)."""
    flavor = f"model.flavor={cfg.model.flavor!r} (GPT-OSS)"
    if cfg.float8.moe_experts != "off":
        raise ConfigError(f"{flavor} with float8.moe_experts='{cfg.float8.moe_experts}': the FP8 grouped GEMM takes "
                          "no expert biases or clamped SwiGLU; set float8.moe_experts='off' (the attention "
                          "projections still run in FP8)")
    # Every block routes (GptOssTransformer builds no dense one, transformers' GptOss neither): the keys that make
    # some dense (MoEArgs.is_moe_layer) are refused, as is a shared expert.
    for field, value, fix, set_ in (
            ("n_dense_layers", args.n_dense_layers, "0", args.n_dense_layers != 0),
            ("sparse_step", args.sparse_step, "1", args.sparse_step != 1),
            ("dense_layers", list(args.dense_layers), "[]", bool(args.dense_layers)),
            ("n_shared_experts", args.n_shared_experts, "0", args.n_shared_experts != 0)):
        if set_:
            raise ConfigError(f"moe.{field}={value} with {flavor}: every GPT-OSS block is routed experts only; "
                              f"set moe.{field}={fix}")


def _check_moe_layout(cfg: JobConfig, args: ModelArgs, pd: ParallelDims) -> None:
    """MoE-only checks that need the flavor's shapes and the resolved degrees."""
    m = cfg.model
    if not family_of(args).has_router:
        if pd.ep > 1:
            raise ConfigError(
                f"distributed.ep={pd.ep} needs an MoE model, but model.flavor={m.flavor!r} is dense; "
                "set distributed.ep=1 or an MoE flavor (debug_moe, moe_small, moe_16b)"
            )
        if cfg.moe.dispatch_dtype == "fp8":
            raise ConfigError(f"moe.dispatch_dtype='fp8' needs an MoE model, but model.flavor={m.flavor!r} is dense; "
                              "set moe.dispatch_dtype='bf16' or an MoE flavor (debug_moe, moe_small, moe_16b)")
        if cfg.moe.dispatch == "padded":
            raise ConfigError(f"moe.dispatch='padded' needs an MoE model, but model.flavor={m.flavor!r} is dense; "
                              "set moe.dispatch='sized' or an MoE flavor (debug_moe, moe_small, moe_16b)")
        changed = [f for f in MoESection.__dataclass_fields__
                   if f not in ("dispatch_dtype", "dispatch", "overlap_all_to_all") and getattr(cfg.moe, f) is not None]
        if changed:
            raise ConfigError(
                f"moe.{changed[0]}={getattr(cfg.moe, changed[0])} has no effect: model.flavor={m.flavor!r} is dense; "
                "remove it or pick an MoE flavor"
            )
        return
    if pd.ep > 1 and args.n_experts % pd.ep:
        raise ConfigError(
            f"distributed.ep={pd.ep} must divide the {args.n_experts} routed experts of model.flavor={m.flavor!r}"
        )
    if cfg.moe.dispatch_dtype == "fp8" and pd.ep == 1:
        raise ConfigError("moe.dispatch_dtype='fp8' needs distributed.ep > 1: at ep=1 no token crosses an all-to-all; "
                          "set distributed.ep or moe.dispatch_dtype='bf16'")
    if cfg.moe.dispatch == "padded":
        _check_padded_dispatch(cfg, pd.ep, args.capacity_factor)
    if cfg.moe.dispatch_dtype == "fp8" and args.dim % 128:
        raise ConfigError(f"moe.dispatch_dtype='fp8' needs model.dim a multiple of 128 (one scale per 1x128 block of "
                          f"each token row), but it is {args.dim}; set moe.dispatch_dtype='bf16'")
    for key, degree in (("tp", pd.tp), ("cp", pd.cp)):
        if degree > 1 and args.capacity_factor > 0:
            raise ConfigError(
                f"moe.capacity_factor={args.capacity_factor} with distributed.{key}={degree}: capacity keeps the "
                f"earliest positions of each sequence, but under {'tensor' if key == 'tp' else 'context'} parallel "
                f"each rank routes its own slice of it; set moe.capacity_factor=0 or distributed.{key}=1"
            )
    t = cfg.train
    if (pd.ep > 1 and t.activation_checkpointing == "selective" and t.selective_ac_every == 0
            and not experts_outside_fsdp(cfg, pd)):
        # The experts' own FSDP2 unit runs different hooks in the recompute than in the forward,
        # which the per-op policy's bookkeeping rejects during backward. Without the unit (ep over the
        # whole shard group) it runs: tests/distributed/test_moe_ep.py.
        raise ConfigError(
            f"train.activation_checkpointing='selective' with the per-op policy (train.selective_ac_every=0) does not "
            f"work with distributed.ep={pd.ep} while the routed experts are an FSDP2 unit of their own (ep below "
            f"dp_shard x cp, dp_replicate > 1, or master weights not in the compute dtype); set "
            "train.selective_ac_every=N (full AC every Nth block), train.activation_checkpointing='full', or ep = "
            "dp_shard"
        )


# -- the pipeline -------------------------------------------------------------

_PP_KEYS = ("pp_split_points", "pp_layers_per_stage", "pp_stages_per_rank")



def _check_padded_dispatch(cfg: JobConfig, ep: int, capacity_factor: float) -> None:
    """moe.dispatch='padded' against the layout and the MoE keys."""
    if ep == 1:
        raise ConfigError("moe.dispatch='padded' needs distributed.ep > 1: at ep=1 no token crosses an all-to-all; "
                          "set distributed.ep or moe.dispatch='sized'")
    if cfg.moe.dispatch_dtype == "fp8":
        raise ConfigError("moe.dispatch='padded' with moe.dispatch_dtype='fp8' is not supported yet (the fp8 "
                          "dispatch's blocks are sized by the host); set moe.dispatch='sized' or "
                          "moe.dispatch_dtype='bf16'")
    if capacity_factor > 0:
        raise ConfigError(f"moe.dispatch='padded' with moe.capacity_factor={capacity_factor}: token dropping reads "
                          "the rows it keeps on the host, the sync the padded all-to-all removes; set "
                          "moe.capacity_factor=0 or moe.dispatch='sized'")

def resolve_pipeline(cfg: JobConfig, *, pp: int, args: ModelArgs) -> PipelineOptions | None:
    """The stage layout and schedule of distributed.pp > 1; None for pp=1 (where the pp_* keys must be unset)."""
    d, t = cfg.distributed, cfg.train
    n_layers = args.n_layers
    if pp == 1:
        for key in _PP_KEYS:
            if getattr(d, key):
                raise ConfigError(f"distributed.{key}={getattr(d, key)!r} is set but distributed.pp=1: "
                                  "set distributed.pp > 1 for pipeline parallelism, or remove it")
        return None
    if d.pp_split_points and d.pp_layers_per_stage:
        raise ConfigError("distributed.pp_split_points and distributed.pp_layers_per_stage both set: give one")
    firsts = _split_point_blocks(d.pp_split_points, n_layers=n_layers)
    costs = _stage_piece_costs(cfg, args)
    schedule, why = _resolve_schedule(cfg, pp=pp, costs=costs, firsts=firsts)
    _check_schedule(cfg, schedule, pp=pp)
    num_stages, key = _num_stages(cfg, schedule, pp=pp, costs=costs, firsts=firsts)
    per_rank = _stages_per_rank(cfg, schedule, pp=pp, num_stages=num_stages, key=key)
    counts = _layer_counts(cfg, costs=costs, num_stages=num_stages, firsts=firsts)
    num_microbatches = t.batch_size // d.pp_microbatch_size
    if num_microbatches < pp:
        logger.warning(
            "pipeline: %d microbatches (train.batch_size=%d / distributed.pp_microbatch_size=%d) for pp=%d: "
            "most ranks idle most of the step; use at least pp (better 2-4x pp) microbatches",
            num_microbatches, t.batch_size, d.pp_microbatch_size, pp,
        )
    return PipelineOptions(schedule=schedule, microbatch_size=d.pp_microbatch_size,
                           num_microbatches=num_microbatches, stages_per_rank=per_rank,
                           stage_fqns=stage_module_fqns(counts, mtp_layers=getattr(args, "mtp_layers", 0)),
                           stage_costs=_stage_shares(costs, counts), schedule_choice=why)


def _resolve_schedule(cfg: JobConfig, *, pp: int, costs: tuple[float, list[float], float], firsts: list[int]
                      ) -> tuple[str, str]:
    """distributed.pipeline_schedule, with `auto` made a schedule, and why auto chose it ("" when set).

    auto = Interleaved1F1B, 2 stages per rank, where every stage gets a block and the microbatches split into
    rounds of pp (measured on 2x H200, 8B shapes x 16 layers, pp=2, 8 microbatches, fp8: 1.021x and 1.016x
    1F1B's step in two calls, for +3.3-4.0 GiB on the first pipeline rank); otherwise 1F1B. Stages set by a
    pp_* key decide it: one per rank is 1F1B, more is Interleaved1F1B."""
    d = cfg.distributed
    if d.pipeline_schedule != "auto":
        return d.pipeline_schedule, ""
    if d.pp_split_points or d.pp_layers_per_stage or d.pp_stages_per_rank:
        num_stages, key = _num_stages(cfg, "1F1B", pp=pp, costs=costs, firsts=firsts)
        if num_stages == pp:
            return "1F1B", f"auto: one stage per rank from {key}"
        return "Interleaved1F1B", f"auto: {num_stages // pp} stages per rank from {key}"
    n_layers = len(costs[1])
    microbatches = cfg.train.batch_size // d.pp_microbatch_size
    if n_layers < 2 * pp:
        return "1F1B", f"auto: {n_layers} blocks cannot give each of 2 x pp={pp} stages one"
    if microbatches < pp or microbatches % _rounds(microbatches, pp):
        return "1F1B", f"auto: {microbatches} microbatches do not make Interleaved1F1B's rounds of pp={pp}"
    return "Interleaved1F1B", "auto: 2 stages per rank, half 1F1B's bubble"


def _rounds(microbatches: int, pp: int) -> int:
    """The rounds torch's interleaved schedules run the microbatches in (each round about pp of them)."""
    return max(1, microbatches // pp)


def _check_schedule(cfg: JobConfig, schedule: str, *, pp: int) -> None:
    """The microbatch size and what the schedule cannot run with."""
    d, t = cfg.distributed, cfg.train
    if t.batch_size % d.pp_microbatch_size:
        raise ConfigError(
            f"distributed.pp_microbatch_size={d.pp_microbatch_size} does not divide train.batch_size={t.batch_size} "
            "(the batch of each data-parallel rank is cut into pipeline microbatches of this size)"
        )
    microbatches = t.batch_size // d.pp_microbatch_size
    cut = f"train.batch_size={t.batch_size} / distributed.pp_microbatch_size={d.pp_microbatch_size}"
    named = f"{d.pipeline_schedule!r}" + (f" ({schedule} here)" if d.pipeline_schedule == "auto" else "")
    if schedule == "1F1B" and microbatches < pp:
        raise ConfigError(
            f"distributed.pipeline_schedule={named} needs at least pp={pp} microbatches, but {cut} gives "
            f"{microbatches}: raise train.batch_size or lower distributed.pp_microbatch_size (or use 'GPipe')"
        )
    rounds = _rounds(microbatches, pp)
    if schedule in INTERLEAVED_SCHEDULES and microbatches % rounds:
        raise ConfigError(
            f"distributed.pipeline_schedule={named} runs the microbatches in {rounds} rounds of about pp={pp}, "
            f"but {cut} gives {microbatches}, not a multiple of {rounds}: make it a multiple of pp"
        )
    if schedule in ZERO_BUBBLE_SCHEDULES:
        # Zero-bubble schedules run each stage's backward in two passes (input grads, then weight grads).
        if torch_version() < ZERO_BUBBLE_MIN_TORCH:
            raise ConfigError(
                f"distributed.pipeline_schedule={schedule!r} needs torch >= "
                f"{'.'.join(map(str, ZERO_BUBBLE_MIN_TORCH))} (this is {torch.__version__}): its weight-gradient pass "
                "fails in older torch at the first step; use 'Interleaved1F1B' or upgrade torch"
            )
        if t.compile_model:
            raise ConfigError(
                f"distributed.pipeline_schedule={schedule!r} with train.compile_model=true: torch's zero-bubble "
                "schedules cannot split the backward of compiled blocks; use 'Interleaved1F1B' or compile_model=false"
            )
        if t.activation_checkpointing == "selective" and t.selective_ac_every == 0:
            raise ConfigError(
                f"distributed.pipeline_schedule={schedule!r} with train.activation_checkpointing='selective' "
                "(per-op policy): a selectively checkpointed region cannot run its backward in two passes; use "
                "activation_checkpointing='full', selective_ac_every > 0, or the 'Interleaved1F1B' schedule"
            )
    if cfg.validation.enable and schedule == "ZBVZeroBubble":
        raise ConfigError(
            "validation.enable=true with distributed.pipeline_schedule='ZBVZeroBubble': torch's forward-only "
            "schedule.eval() cannot run the V-shaped zero-bubble schedule (it fails at the first evaluation); use "
            "another schedule (e.g. InterleavedZeroBubble) or validation.enable=false"
        )


def _split_point_blocks(entries: list[str], *, n_layers: int) -> list[int]:
    """The first block of each later stage, from distributed.pp_split_points ([] when unset)."""
    firsts = []
    for entry in entries:
        block = parse_split_point(entry)
        if block is None or block >= n_layers:
            raise ConfigError(
                f"distributed.pp_split_points entry {entry!r} names no module: split points are "
                f"'layers.N' blocks, layers.0..layers.{n_layers - 1} in this model"
            )
        firsts.append(block)
    if any(a >= b for a, b in zip(firsts, firsts[1:])):
        raise ConfigError(f"distributed.pp_split_points={entries} must be in increasing block order")
    return firsts


def _stage_piece_costs(cfg: JobConfig, args: ModelArgs) -> tuple[float, list[float], float]:
    """(embedding, each block, final norm + head): training FLOPs per token (trainer.models.pipeline_costs), the
    edge pieces replaced by pp_embedding_weight / pp_head_weight blocks of the mean block cost when set."""
    d = cfg.distributed
    embedding, blocks, head = pipeline_costs(args, cfg.train.seq_len)
    mean = sum(blocks) / len(blocks)
    if d.pp_embedding_weight != -1:
        embedding = d.pp_embedding_weight * mean
    if d.pp_head_weight != -1:
        head = d.pp_head_weight * mean
    return embedding, blocks, head


def _stage_shares(costs: tuple[float, list[float], float], counts: list[int]) -> tuple[float, ...]:
    """Each stage's share of the model's cost, for the startup log."""
    embedding, blocks, head = costs
    shares, start = [], 0
    for i, count in enumerate(counts):
        shares.append(sum(blocks[start:start + count]) + (embedding if i == 0 else 0.0)
                      + (head if i == len(counts) - 1 else 0.0))
        start += count
    total = sum(shares) or 1.0
    return tuple(x / total for x in shares)


def _num_stages(cfg: JobConfig, schedule: str, *, pp: int, costs: tuple[float, list[float], float], firsts: list[int]
                ) -> tuple[int, str]:
    """How many stages (explicit split points, a per-stage cost budget, or pp x stages per rank), and the key
    that decided it."""
    d = cfg.distributed
    embedding, blocks, head = costs
    n_layers = len(blocks)
    if d.pp_split_points:
        num_stages, key = len(firsts) + 1, "distributed.pp_split_points"
    elif d.pp_layers_per_stage:
        in_blocks = (embedding + sum(blocks) + head) / (sum(blocks) / n_layers)
        num_stages, key = math.ceil(in_blocks / d.pp_layers_per_stage - 1e-9), "distributed.pp_layers_per_stage"
    else:
        num_stages = pp * (d.pp_stages_per_rank or default_stages_per_rank(schedule))
        key = "distributed.pp_stages_per_rank" if d.pp_stages_per_rank else "distributed.pp"
    if num_stages > n_layers + 2:
        raise ConfigError(
            f"{key}: {num_stages} pipeline stages but the model has only {n_layers} blocks (+ embedding and head = "
            f"{n_layers + 2} pieces, at least one per stage); lower distributed.pp or distributed.pp_stages_per_rank"
        )
    if num_stages % pp:
        raise ConfigError(f"{key} gives {num_stages} pipeline stages, not a multiple of distributed.pp={pp}")
    return num_stages, key


def _stages_per_rank(cfg: JobConfig, schedule: str, *, pp: int, num_stages: int, key: str) -> int:
    """Stages per pp rank, checked against what the schedule runs."""
    d = cfg.distributed
    per_rank = num_stages // pp
    if d.pp_stages_per_rank and d.pp_stages_per_rank != per_rank:
        raise ConfigError(f"distributed.pp_stages_per_rank={d.pp_stages_per_rank} but {key} gives {per_rank} "
                          f"stages per rank ({num_stages} stages over pp={pp})")
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ConfigError(
            f"distributed.pipeline_schedule={schedule!r} runs one stage per rank, but {key} gives {per_rank}; "
            "use 'Interleaved1F1B' for several stages per rank"
        )
    if schedule not in SINGLE_STAGE_SCHEDULES and per_rank < 2:
        raise ConfigError(
            f"distributed.pipeline_schedule={schedule!r} needs at least 2 stages per rank, but {key} gives "
            f"{per_rank}; use '1F1B' for one stage per rank"
        )
    if schedule in V_SCHEDULES and per_rank != 2:
        raise ConfigError(f"distributed.pipeline_schedule={schedule!r} runs exactly 2 stages per rank (a V), "
                          f"but {key} gives {per_rank}")
    return per_rank


def _layer_counts(cfg: JobConfig, *, costs: tuple[float, list[float], float], num_stages: int,
                  firsts: list[int]) -> list[int]:
    """Blocks per stage: at the explicit split points, or the split that balances the stages' costs."""
    embedding, blocks, head = costs
    if cfg.distributed.pp_split_points:
        return split_at(len(blocks), firsts)
    return cost_split(blocks, num_stages, embedding_cost=embedding, head_cost=head)
