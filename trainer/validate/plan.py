"""The per-GPU memory plan: what one rank holds at its peak, in closed form from the resolved job (nothing is built).

`scripts/train.py --dry-run` prints it; the validation pass warns when it exceeds a GPU (memory.py refuses what
cannot fit, the training state alone) and refuses a CPU run it does not fit: there the device is the host's memory,
shared with the system, and past it the machine swaps or the kernel kills a process. Bytes, per rank:

    resident     master weights, AdamW's two moments (and the Kahan buffer): sharded over dp_shard x cp x tp
                 (pp: this rank's stages); gradients exist in full only from the end of backward to the step
    gathered     the compute-dtype copies FSDP2 all-gathers: every unit of the rank where weights stay gathered
                 from forward to backward (one shard group, or pipeline stages), else the root (final norm, head)
                 and the two blocks a backward step holds (the running one and the prefetched one)
    activations  what a block saves for backward, per token, by AC mode (its family's, below), times this rank's tokens in
                 flight (a microbatch; under pp the schedule's microbatches in flight at this rank); in the compute
                 dtype (an fp32 run's twice a bf16 one's), and on a CPU with document masking each block's copy of
                 the dense [batch, 1, seq, seq] mask (trainer/models/activations.py)
    loss         the largest transient: the logits and what the head's backward makes of them

The peak is the larger of two moments: the start of backward (resident + gathered + activations + the larger of
the loss's transient and a block's backward: its MLP's three gradients, 6f bytes per token, and under full AC its
activations again, the loss's transient being freed by then; with gradient
accumulation or a pipeline, the gradients earlier microbatches left), and the optimizer step (resident + every
gradient).

What a block saves per token, and its parameters, are its model family's (`ModelFamily.activation_bytes` and
`block_params`, trainer/models/activations.py has the table); the plan asks one block of each run of alike blocks
(`block_runs`) and counts each rank's blocks of that run. The loss (bf16 logits: tokens x vocab x 2): compiled, the
logits and the head's weight gradient, or with an fp8 head two fp8 copies of the logits' gradient instead; eager,
12 bytes per logit (fp32 log-softmax output, its gradient and the cast's); chunked, one chunk's worth plus a
second head-weight gradient.

Approximate by construction: tensor parallelism divides activations by tp (the sequence-parallel norms and the
gathered GEMM inputs are not told apart), context parallelism divides tokens by cp, expert parallelism's
all-to-all buffers and the pipeline schedules' exact timing are estimated, allocator fragmentation is not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trainer.config import JobConfig
from trainer.models import ModelArgs, family_of
from trainer.models.activations import ActivationPolicy
from trainer.optim.states import StateDtypes
from trainer.parallel import BuildOptions, ParallelDims
from trainer.parallel.float8.options import kept_weight_bytes
from trainer.parallel.pipeline_layout import PipelineOptions, stage_ids

GIB = 2**30

# What lowers the peak, for a plan over the device's memory.
LOWER_THE_PEAK = ("lower train.batch_size or train.seq_len, set train.activation_checkpointing or "
                  "train.loss_chunk_tokens, or shard over more ranks")


@dataclass(frozen=True)
class MemoryRow:
    what: str
    bytes: int
    how: str


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory at its peak (the pipeline rank that holds the most), as rows that sum to `peak_bytes`."""

    rows: tuple[MemoryRow, ...]
    peak_bytes: int
    peak_at: str
    """When the peak happens: "the start of backward", "a block's backward" or "the optimizer step"."""
    pp_rank: int
    params_per_rank: int
    optimizer_step_bytes: int
    """Weights, optimizer state and every gradient: the optimizer step's memory (activations freed)."""
    notes: tuple[str, ...] = ()
    """What the rows alone would leave a reader to wonder (a selective AC row equal to none's), printed under them."""

    def fits(self, capacity: tuple[int, str] | None) -> bool:
        """Whether the peak fits `capacity` ((bytes, what)); True when it cannot be told."""
        return capacity is None or self.peak_bytes <= capacity[0]

    def table(self, *, capacity: tuple[int, str] | None = None) -> str:
        """The rows, the peak, and against `capacity` ((bytes, what)) the headroom."""
        width = max(len("at the optimizer step"), *(len(r.what) for r in self.rows))
        lines = [f"  {r.what:<{width}}  {_size(r.bytes)}  {r.how}" for r in self.rows]
        lines.append(f"  {'peak (estimate)':<{width}}  {_size(self.peak_bytes)}  at {self.peak_at}")
        if self.optimizer_step_bytes < self.peak_bytes:
            lines.append(f"  {'at the optimizer step':<{width}}  {_size(self.optimizer_step_bytes)}  weights, "
                         "optimizer state and every gradient (activations freed)")
        if capacity:
            cap, what = capacity
            lines.append(f"  {'':<{width}}  " + (
                f"fits {what} with {(cap - self.peak_bytes) / GIB:.1f} GiB to spare" if self.peak_bytes <= cap else
                f"MORE than {what} by {(self.peak_bytes - cap) / GIB:.1f} GiB"))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Stage:
    """What one pipeline rank holds: its blocks, counted per run of alike blocks (the family's block_runs), and the
    model's ends."""

    blocks: tuple[int, ...]
    embeddings: bool
    head: bool
    microbatches_in_flight: float
    """Microbatches whose activations this rank holds at once (one chunk of its stages' layers each): under an
    interleaved schedule the stages' chunks in flight weighted by their blocks."""
    receive_buffers: int = 0
    """Microbatch-sized hidden states torch.distributed.pipelining keeps to receive into: one per microbatch for each
    input from (and gradient from) a stage on another rank, allocated once and held for the run."""


def _dtype_bytes(dtype: torch.dtype | None, default: int) -> int:
    return default if dtype is None else dtype.itemsize


def plan_memory(cfg: JobConfig, args: ModelArgs, pd: ParallelDims, build: BuildOptions,
                pipeline: PipelineOptions | None, float8_layers: dict[str, str] | None, *,
                cpu: bool = False) -> MemoryPlan:
    """The memory plan of the rank that holds the most (every pipeline rank is planned; one without pp). cpu: the
    run trains on a CPU (document masking's dense mask, trainer/models/activations.py)."""
    return max(plan_ranks(cfg, args, pd, build, pipeline, float8_layers, cpu=cpu), key=lambda p: p.peak_bytes)


def plan_ranks(cfg: JobConfig, args: ModelArgs, pd: ParallelDims, build: BuildOptions,
               pipeline: PipelineOptions | None, float8_layers: dict[str, str] | None, *,
               cpu: bool = False) -> list[MemoryPlan]:
    """The memory plan of each pipeline rank (one without pp)."""
    # A bf16 backward (float8.backward) saves the bf16 input and weight, as a bf16 Linear does: its blocks and head
    # keep a bf16 run's bytes (measured: 43.24 GiB beside bf16's plan 42.86 at 8B shapes x 8 layers, batch 4).
    bf16_backward = build.float8 is not None and build.float8.backward == "bf16"
    fp8 = _Fp8() if bf16_backward else _Fp8.of(float8_layers)
    stages = _stages(args, pd, pipeline)
    return [_plan_rank(cfg, args, pd, build, fp8, stage, pp_rank=r, cpu=cpu) for r, stage in enumerate(stages)]


def _stages(args: ModelArgs, pd: ParallelDims, pipeline: PipelineOptions | None) -> list[_Stage]:
    runs = family_of(args).block_runs(args)
    if pipeline is None:
        return [_Stage(tuple(len(r) for r in runs), True, True, 1.0)]
    stages = []
    for rank in range(pd.pp):
        mine = stage_ids(rank, pd.pp, pipeline.num_stages, v_style=pipeline.v_style)  # in model order
        groups = [pipeline.stage_fqns[s] for s in mine]
        layers = [int(f.split(".")[1]) for fqns in groups for f in fqns if f.startswith("layers.")]
        blocks = tuple(sum(1 for i in layers if i in r) for r in runs)
        per_stage = [sum(1 for f in fqns if f.startswith("layers.")) for fqns in groups]
        chunks = _chunks_in_flight(pipeline, pp=pd.pp, rank=rank)
        in_flight = (sum(c * b for c, b in zip(chunks, per_stage)) / sum(per_stage) if sum(per_stage)
                     else sum(chunks) / max(1, len(groups)))
        neighbours = sum((s > 0 and s - 1 not in mine) + (s < pipeline.num_stages - 1 and s + 1 not in mine)
                         for s in mine)
        stages.append(_Stage(blocks, any("tok_embeddings" in f for f in groups),
                             any("output_head" in f for f in groups), in_flight,
                             receive_buffers=neighbours * pipeline.num_microbatches))
    return stages


def _chunks_in_flight(pipeline: PipelineOptions, *, pp: int, rank: int) -> list[float]:
    """For each of rank `rank`'s stages (in model order), the microbatches whose activations it holds before the
    rank's first backward frees one: the schedule's warm-up forwards and the first steady forward."""
    n, v = pipeline.num_microbatches, pipeline.stages_per_rank
    if pipeline.schedule == "GPipe":
        return [n] * v
    if v == 1:  # 1F1B: warm-up forwards, then one forward per backward
        return [min(n, pp - rank)]
    if pipeline.v_style:  # V schedules: their warm-up, spread evenly over the rank's stages
        return [min(n * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1) / v] * v
    # Interleaved: torch's warm-up ((v - 1) rounds of microbatches and 2 per hop from the last rank), forward i on
    # local stage (i // microbatches per round) % v
    per_round = n // max(1, n // pp)
    forwards = min(n * v, (v - 1) * per_round + 2 * (pp - 1 - rank) + 1)
    return [sum(1 for i in range(forwards) if (i // per_round) % v == k) for k in range(v)]


@dataclass(frozen=True)
class _Fp8:
    """Which of the model's GEMMs run in FP8 (float8_layers): what the block saves depends on it."""

    attention: bool = False
    mlp: bool = False
    head: bool = False

    @classmethod
    def of(cls, float8_layers: dict[str, str] | None) -> _Fp8:
        converted = [fqn for fqn, fate in (float8_layers or {}).items() if fate == "converted"]
        return cls(attention=any(".attention." in f for f in converted), mlp=any(".mlp." in f for f in converted),
                   head=any(f.startswith("output_head.") for f in converted))


def _policy(build: BuildOptions, fp8: _Fp8, *, compute: int, cpu: bool, ep: int) -> ActivationPolicy:
    """What decides the bytes a block saves, from the build: full AC on every `selective_every`-th block is counted
    as blocks without AC and blocks with full AC (`_activations`); activations of `compute` bytes; on a CPU,
    document masking's dense mask; under moe.dispatch='padded' the routed experts' rows of all `ep` slots."""
    ac = build.ac.mode if build.ac.mode == "full" or not build.ac.selective_every else "none"
    return ActivationPolicy(compiled=build.compile, ac=ac, fp8_attention=fp8.attention, fp8_mlp=fp8.mlp,
                            fp8_delayed=build.float8 is not None and build.float8.delayed is not None,
                            compute_bytes=compute,
                            dense_mask_seq=build.seq_len if cpu and build.document_eos is not None else 0,
                            routed_slots=ep if build.moe_padded_dispatch else 1)


def _run_activations(args: ModelArgs, policy: ActivationPolicy) -> list[tuple[int, int]]:
    """(saved, backward) bytes per token of one block of each run of alike blocks."""
    family = family_of(args)
    return [family.activation_bytes(args, run[0], policy) for run in family.block_runs(args)]


def _moment_bytes(cfg: JobConfig, *, bf16_master: bool) -> dict[str, float]:
    """AdamW's two moments' bytes per parameter: optimizer.exp_avg_dtype / exp_avg_sq_dtype (an fp8 exp_avg with
    its block scales, 1 + 4/128, counted for every parameter: 1-D tensors keep bf16, a rounding error here)."""
    sizes = StateDtypes.resolve(bf16_master=bf16_master, exp_avg=cfg.optimizer.exp_avg_dtype,
                                exp_avg_sq=cfg.optimizer.exp_avg_sq_dtype).bytes_per_param()
    return {k: v for k, v in sizes.items() if k != "master"}


def _plan_rank(cfg: JobConfig, args: ModelArgs, pd: ParallelDims, build: BuildOptions, fp8: _Fp8, stage: _Stage,
               *, pp_rank: int, cpu: bool) -> MemoryPlan:
    fsdp = build.fsdp
    master = _dtype_bytes(fsdp.master_dtype, 4)
    compute = _dtype_bytes(fsdp.param_dtype, master)
    kahan = 2 if master == 2 and cfg.optimizer.bf16_update == "kahan" else 0
    moments = _moment_bytes(cfg, bf16_master=master == 2)
    params = _stage_params(args, stage)
    shards = pd.fsdp_shard * pd.tp
    local = params // shards
    tokens = microbatch_tokens(cfg) / pd.cp
    buffers = [MemoryRow("pipeline buffers", int(stage.receive_buffers * tokens * args.dim * compute),
                         f"{stage.receive_buffers} receive buffers of a microbatch's hidden states (one per "
                         "microbatch for each neighbouring stage on another rank)")] if stage.receive_buffers else []
    rows = [MemoryRow("weights (sharded)", local * master, f"{_count(params)} parameters / {shards} rank"
                                                             f"{'s' if shards > 1 else ''} x {master} B "
                                                             f"({_name(master)} master weights)"),
            MemoryRow("optimizer state", int(local * (sum(moments.values()) + kahan)),
                      " + ".join(f"{k} {v:.3g} B" for k, v in moments.items()) + " per parameter"
                      + (" + the 2 B Kahan buffer" if kahan else "")),
            *([MemoryRow("EMA weights", local * 4, f"train.ema_decay={cfg.train.ema_decay:g}: 4 B (fp32) per "
                                                     "parameter of the shard")] if cfg.train.ema_decay > 0 else []),
            *buffers,
            _gathered(args, pd, stage, all_units=not fsdp.reshard_after_forward, compute=compute,
                      experts_left_out=fsdp.experts_outside)]
    kept = len(rows) - 1  # weights, optimizer state, the EMA and pipeline buffers: held for the whole run
    policy = _policy(build, fp8, compute=compute, cpu=cpu, ep=pd.ep)
    activations, recompute = _activations(args, pd, build, policy, stage, tokens=tokens)
    rows.append(activations)
    if build.float8 is not None and build.float8.weights_per_step:
        rows.append(_kept_fp8_weights(args, build.float8.kept_weight_numel, stage, head=fp8.head,
                                      recipe=build.float8.recipe))
    if (build.float8 is not None and build.float8.expert_weights_per_step and build.float8.moe_experts != "off"
            and not build.float8.experts_unavailable):
        rows.append(_kept_expert_weights(args, pd, stage, both=cfg.train.grad_accum_steps > 1 or pd.pp > 1))
    loss = _loss_bytes(args, pd, build, fp8, tokens=tokens, compute=compute) if stage.head else 0
    if stage.head:
        rows.append(MemoryRow("logits and loss", loss, _loss_how(build)))
    if cfg.train.grad_accum_steps > 1 or pd.pp > 1:  # a later microbatch's backward adds to the sharded gradients
        rows.append(MemoryRow("gradients", local * master, f"{master} B each, summed over the step's microbatches"))
    full_ac = build.ac.mode == "full" or bool(build.ac.mode == "selective" and build.ac.selective_every)
    if recompute > loss:
        rows.append(MemoryRow("block backward", recompute - loss,
                              ("one block's activations again and " if full_ac else "")
                              + "its MLP's gradients in its backward, beyond the loss's transient"))
    optimizer_step = int(local * (2 * master + sum(moments.values()) + kahan)) + sum(r.bytes for r in rows[2:kept])
    notes = (_SELECTIVE_KEEPS_ALL,) if _selective_saves_nothing(args, build, policy) else ()
    start_of_backward = sum(r.bytes for r in rows)
    if optimizer_step >= start_of_backward:
        rows = rows[:kept] + [MemoryRow("gradients", local * master,
                                     f"{master} B each, complete from the end of backward to the optimizer step")]
        peak, at = optimizer_step, "the optimizer step"
    else:
        peak, at = start_of_backward, "a block's backward" if recompute > loss else "the start of backward"
    return MemoryPlan(rows=tuple(rows), peak_bytes=peak, peak_at=at, pp_rank=pp_rank, params_per_rank=local,
                      optimizer_step_bytes=optimizer_step, notes=notes)


# Compiled with fp8 linears, the partitioner already recomputes the normed inputs, o_proj's output and the SwiGLU
# product from what the float8 casts need (module docstring): what the block saves is the GEMM and attention outputs,
# which is what selective AC's per-op policy keeps. tests/unit/test_memory_plan_graphs.py holds both to the graphs.
_SELECTIVE_KEEPS_ALL = (
    "selective AC saves no memory here: compiled with fp8 linears, a block already keeps only its GEMM and attention "
    "outputs (the compiler recomputes the norms, o_proj's output and the SwiGLU product from the fp8 casts' inputs), "
    "which is what selective AC keeps; train.selective_ac_every=N or full AC saves activations")


def _selective_saves_nothing(args: ModelArgs, build: BuildOptions, policy: ActivationPolicy) -> bool:
    """Per-op selective AC whose saved activations are within a few bytes per token of no AC's (the norms' rstd)."""
    if build.ac.mode != "selective" or build.ac.selective_every:
        return False
    none = _run_activations(args, dataclasses.replace(policy, ac="none"))
    selective = _run_activations(args, policy)
    return all(a[0] - b[0] <= 4 * policy.compute_bytes for a, b in zip(none, selective))  # the norms' fp32 rstd


def _run_params(args: ModelArgs) -> list[tuple[int, int]]:
    """(parameters, of which routed experts') of one block of each run of alike blocks."""
    family = family_of(args)
    return [family.block_params(args, run[0]) for run in family.block_runs(args)]


def _stage_params(args: ModelArgs, stage: _Stage) -> int:
    v, d = args.vocab_size, args.dim
    ends = (v * d if stage.embeddings else 0) + (d + v * d if stage.head else 0)
    if args.tie_word_embeddings and stage.embeddings and stage.head:
        ends -= v * d  # one table
    return sum(n * params for n, (params, _) in zip(stage.blocks, _run_params(args))) + ends


def _kept_fp8_weights(args: ModelArgs, numel: int, stage: _Stage, *, head: bool, recipe: str) -> MemoryRow:
    """float8.weights_per_step: what the rank's stage holds for its converted Linears at the start of backward: the
    kept cast (`Fp8WeightsPerStep`: e4m3 (out, in), 1 B per weight element, blockwise with one fp32 scale per 128x128
    block), and for each microbatch in flight the column-major byte copy of it that the input-gradient GEMM multiplies
    (torchao's `preprocess_addmm` for tensorwise, blockwise.py's dgrad), made from the kept cast, not cast again:
    compiled, each microbatch's forward makes its copy and saves it for its backward, 1 B per element. Measured on
    H200s (torch 2.11, compiled, 2026-11-28): one GPU, +2 B per converted element at accumulation 1 and 4 alike (one
    microbatch in flight at a time); pp=2 1F1B with 8 microbatches, +3 B on pipeline rank 0 (two in flight) and +2 B
    on rank 1 (one). The blocks' share by their count."""
    head_numel = args.vocab_size * args.dim if head else 0
    elements = (numel - head_numel) * sum(stage.blocks) // max(1, args.n_layers) + (head_numel if stage.head else 0)
    in_flight = stage.microbatches_in_flight
    return MemoryRow("FP8 weights kept through the step",
                     kept_weight_bytes(elements, recipe=recipe) + int(elements * in_flight),
                     "float8.weights_per_step: each converted Linear's weight cast once per step, 1 B per parameter"
                     + (" and 4 B per 128x128 block" if recipe == "blockwise" else "")
                     + ", and its column-major copy for the input-gradient GEMM, 1 B"
                     + (f" x {in_flight:g} microbatches in flight" if in_flight != 1 else ""))


def _kept_expert_weights(args: ModelArgs, pd: ParallelDims, stage: _Stage, *, both: bool) -> MemoryRow:
    """The FP8 routed experts' weights kept through the step (`Fp8ExpertWeights` with per_step): each MoE layer
    quantizes its forward orientation (w13, w2) at its first forward and its dgrad orientation (w13_t, w2_t) at its
    first backward, 1 B per expert parameter each, and keeps both until the step's forward/backward ends. With
    more than one microbatch per step (accumulation, pipeline) an earlier backward has made the dgrad copies
    before the peak's backward starts: 2 B. With one, the start of backward holds the forward copies only (1 B);
    the dgrad copies arrive block by block as each block's backward frees its activations. Without per_step at most
    one layer's copy is alive at a time (a transient the plan does not count, "off" or "on"). The rowwise scales (4 B
    per row of 2048 or more elements) are not counted; the family's routed count includes the router's gate (under
    0.1% more)."""
    local = sum(k * routed // pd.ep for k, (_, routed) in zip(stage.blocks, _run_params(args)))
    per_param = 2 if both else 1
    return MemoryRow("FP8 expert weights kept through the step", local * per_param,
                     "float8.weights_per_step: the routed experts quantized once per step, "
                     + ("both orientations (forward and dgrad), 2 B per expert parameter" if both else
                        "the forward orientation at the start of backward (one microbatch), 1 B per expert parameter"))


def _gathered(args: ModelArgs, pd: ParallelDims, stage: _Stage, *, all_units: bool, compute: int,
              experts_left_out: bool) -> MemoryRow:
    """The compute-dtype weights FSDP2 has all-gathered at the start of backward: every unit where none is
    resharded after forward, else the root (head; a tied table with it) and the two blocks a backward step holds.
    experts_left_out: FSDP2 does not manage the routed experts (trainer.parallel.fsdp), so makes no copy of them."""
    runs = _run_params(args)
    # routed experts are split over ep, never gathered over it (and with no copy at all when left out of FSDP2)
    not_gathered = [routed if experts_left_out else routed - routed // pd.ep for _, routed in runs]
    if all_units:
        n = _stage_params(args, stage) - sum(k * extra for k, extra in zip(stage.blocks, not_gathered))
        how = "every unit (kept gathered from forward to backward)"
    else:
        largest = max((params - extra for k, (params, _), extra in zip(stage.blocks, runs, not_gathered) if k),
                      default=0)
        tied = args.vocab_size * args.dim if args.tie_word_embeddings and stage.embeddings else 0
        n = (args.vocab_size * args.dim + args.dim if stage.head else 0) + tied + 2 * largest
        how = "the root (head) and 2 blocks"
    return MemoryRow("gathered weights", n // pd.tp * compute, f"{_name(compute)} copies of {how}")


def _activations(args: ModelArgs, pd: ParallelDims, build: BuildOptions, policy: ActivationPolicy, stage: _Stage, *,
                 tokens: float) -> tuple[MemoryRow, int]:
    """(the saved activations' row, the bytes a block's backward adds: a checkpointed block's activations again,
    its MLP's gradients)."""
    runs = _run_activations(args, policy)
    blocks = sum(stage.blocks)
    per_token = sum(k * saved for k, (saved, _) in zip(stage.blocks, runs))
    again = [backward for _, backward in runs]
    every = build.ac.selective_every if build.ac.mode == "selective" else 0
    if every:  # full AC on every `every`-th block (which keeps its input: the bf16 residual stream), the others all
        per_token = per_token * (1 - 1 / every) + blocks / every * policy.compute_bytes * args.dim
        again = [saved + backward for saved, backward in runs]
    per_token /= pd.tp
    in_flight = stage.microbatches_in_flight
    ac = build.ac.mode + (f" every {every}" if every else "")
    row = MemoryRow("activations", int(per_token * tokens * in_flight),
                    f"{per_token / max(1, blocks) / 1e3:.1f} KB per token per block x {blocks} blocks x "
                    f"{tokens:,.0f} tokens" + (f" x {in_flight:g} microbatches in flight" if in_flight != 1 else "")
                    + f" (AC {ac}, {'compiled' if build.compile else 'eager'})")
    most = max((a for k, a in zip(stage.blocks, again) if k), default=0)
    return row, int(most * tokens / pd.tp)


def microbatch_tokens(cfg: JobConfig) -> int:
    """Tokens of one microbatch (a pipeline microbatch under pp, else train.batch_size sequences)."""
    t, d = cfg.train, cfg.distributed
    return (d.pp_microbatch_size if d.pp > 1 else t.batch_size) * t.seq_len


def _loss_bytes(args: ModelArgs, pd: ParallelDims, build: BuildOptions, fp8: _Fp8, *, tokens: float,
                compute: int) -> int:
    """The loss's transient: bf16 logits and what the head's backward makes of them (module docstring)."""
    v, d = args.vocab_size, args.dim
    if build.loss_parallel and pd.tp > 1:
        v = v // pd.tp
    chunk = min(tokens, build.loss_chunk_tokens) if build.loss_chunk_tokens else tokens
    head_grad = args.vocab_size * d * compute // pd.tp
    if not build.compile_loss:
        logits, extra = 12 * chunk * v, head_grad
    else:
        logits, extra = compute * chunk * v, 2 * chunk * v if fp8.head else head_grad
    if build.loss_chunk_tokens:
        extra += head_grad  # each chunk's head-weight gradient, added to the running one
    # DeepSeek-V3's MTP depths (trainer.models.mtp): each depth's logits, eager, held with the main ones until the
    # backward of their sum, and its states (its share of the model's output and its head norm's).
    mtp = getattr(args, "mtp_layers", 0) * (12 * chunk * v + 2 * tokens * d * compute)
    return int(logits + extra + tokens * d * compute + mtp)


def _loss_how(build: BuildOptions) -> str:
    chunk = f"{build.loss_chunk_tokens:,}-token chunks" if build.loss_chunk_tokens else "all tokens at once"
    return f"{'compiled' if build.compile_loss else 'eager'} head and cross-entropy, {chunk}"


def _size(nbytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB, right-aligned in 12 characters."""
    return f"{nbytes / GIB:8.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:8.1f} MiB"


def human_size(nbytes: float) -> str:
    """Bytes for a log line: "40.3 GiB", or "41.9 MiB" below one GiB (a small model is not "0.0 GiB")."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _name(nbytes: int) -> str:
    return {1: "fp8", 2: "bf16", 4: "fp32"}.get(nbytes, f"{nbytes}-byte")
