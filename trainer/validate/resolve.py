"""What the build needs, resolved once from the checked config: model arguments, FP8 and build options, data.

Also the checks that need more than the config: an FP8 exclusion that matches no Linear of
the model, a GPU without FP8 tensor cores under `float8.require`, data files and their
headers (`trainer.data.loader.build_source`), enough held-out samples for validation.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from trainer.config import JobConfig
from trainer.config.checks import mix_names
from trainer.config.model_sections import key_fields, overrides
from trainer.data.batch_warmup import BatchWarmup
from trainer.data.loader import build_source, shard_paths
from trainer.data.mix import HeldOutMixture, MixEntry, MixtureSource
from trainer.data.sources import SampleSource
from trainer.data.tasks import TaskRows, read_task
from trainer.data.tokenizer import build_tokenizer, eos_id
from trainer.errors import ConfigError
from trainer.validate.float8_roles import all_gather_with_roles, check_float8_roles, resolve_bf16_blocks
from trainer.model_values import SAVED_INTEGERS, values_problem
from trainer.models import FLAVORS, ModelArgs, build_model, family_of
from trainer.parallel import ACOptions, BuildOptions, FSDPOptions, ParallelDims
from trainer.parallel.float8 import (
    DelayedScalingSettings, Float8Options, fp8_grouped_supported, fp8_supported, local_device, resolve_format,
    select_float8_linears,
)

logger = logging.getLogger(__name__)

# FSDP2's param_dtype per train.mixed_precision (None: compute in the fp32 master weights).
_COMPUTE_DTYPE: dict[str, torch.dtype | None] = {
    "fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16,
}


def resolve_model_args(cfg: JobConfig) -> ModelArgs:
    """The flavor's shapes with every [model] and [moe] key that is set, checked as one, and a RoPE table at least
    train.seq_len long."""
    m, t = cfg.model, cfg.train
    if m.flavor not in FLAVORS:
        raise ConfigError(f"model.flavor={m.flavor!r} is not one of {', '.join(repr(f) for f in FLAVORS)}")
    flavor = FLAVORS[m.flavor]
    if family_of(flavor).has_router and m.ffn_dim is not None:
        raise ConfigError(f"model.ffn_dim={m.ffn_dim} with the MoE flavor {m.flavor!r}: its dense blocks' width is "
                          "moe.dense_ffn_dim (the experts' moe.moe_ffn_dim)")
    # The sections of the flavor's args ([moe] for an MoE flavor); one that is not, with a key set: layout.py.
    sections = [(name, section) for name, section in cfg.shape_sections() if isinstance(flavor, section.args_class)]
    args = replace(flavor, **{k: v for _, section in sections for k, v in overrides(section, flavor).items()})
    # The effective values, checked as one (each key's own range was checked with the config): combinations such
    # as dim and n_heads, and what the flavor's values make of the keys set (a derived ffn_dim, head_dim).
    values = {f: getattr(args, f) for f in args.__dataclass_fields__ if f not in ("rope_scaling", "rope_yarn")} | {
        "ffn_dim": args.ffn_dim}
    keys = {field: f"{name}.{key}" for name, section in sections for field, key in key_fields(section).items()}
    if problem := values_problem(values, keys=keys):
        raise ConfigError(f"{problem} (model.flavor={m.flavor!r} and the [model] and [moe] keys set)")
    if t.seq_len > args.max_seq_len:
        # Allowed (long-context training), never silent: the position table grows.
        logger.warning("train.seq_len=%d is longer than the model's max_seq_len=%d (model.flavor=%r%s): the RoPE "
                       "table is extended to %d positions", t.seq_len, args.max_seq_len, m.flavor,
                       " with model.max_seq_len" if m.max_seq_len else "", t.seq_len)
        args = replace(args, max_seq_len=t.seq_len)
    return args


def shard_group_on_one_node(pd: ParallelDims, ranks_per_node: int) -> bool:
    """Do the ranks FSDP shards a weight over (dp_shard x cp, tp ranks between them) lie on one machine? torchrun
    numbers a machine's ranks consecutively, and the world mesh puts cp and tp inside dp_shard."""
    return pd.fsdp_shard * pd.tp <= ranks_per_node


def resolve_float8(cfg: JobConfig, args: ModelArgs, pd: ParallelDims, *, probe: bool = True, ranks_per_node: int = 8
                   ) -> tuple[Float8Options, dict[str, str]]:
    """The FP8 options of an fp8 run and every Linear's fate (fqn -> "converted" or why it is excluded).

    Every exclusion must match a Linear; the GPU is probed under float8.require (probe=False: a dry run, which
    plans for GPUs with FP8 tensor cores).
    """
    f8 = cfg.float8
    check_float8_roles(cfg)
    bf16_blocks = resolve_bf16_blocks(cfg, args.n_layers)
    all_gather = f8.enable_fsdp_float8_all_gather
    if all_gather == "auto":  # rowwise and blockwise weights are all-gathered in bf16
        # Only where the shard group crosses machines: there the gather's bytes cost (fp8 halves them); within one,
        # NVLink moves bf16 weights behind the compute, and the eager cast before each gather costs the host time
        # the first blocks wait for (docs/distributed.md#fsdp2s-automatic-choices).
        all_gather = (f8.recipe == "tensorwise" and pd.fsdp_shard > 1
                      and not shard_group_on_one_node(pd, ranks_per_node))
        if all_gather and cfg.validation.enable and cfg.validation.mixed_precision == "bf16":
            all_gather = False
            logger.info("float8.enable_fsdp_float8_all_gather='auto': off, as validation.mixed_precision='bf16' "
                        "evaluates with the bf16 weights (gathered float8 weights have no bf16 copy)")
        all_gather = all_gather_with_roles(cfg, all_gather)
    with torch.device("meta"):
        shapes = build_model(args)
    try:
        converted, excluded, _ = select_float8_linears(shapes, exclude_fqns=list(f8.exclude_fqns), recipe=f8.recipe,
                                                       bf16_blocks=bf16_blocks)
    except ValueError as e:  # an exclude_fqns entry that matches nothing
        raise ConfigError(str(e)) from None
    # What really runs is decided here, once: every startup line (the precision line, fp8_layers.json, the memory
    # plan) tells the story of the FP8 matmuls this device runs, not of the ones the config asked for.
    unavailable = _probe_fp8(require=f8.require, emulate=f8.emulate, recipe=f8.recipe) if probe else ""
    experts_unavailable = _check_fp8_experts(cfg, args, probe=probe) if f8.moe_experts != "off" else ""
    options = Float8Options(recipe=f8.recipe, enable_fsdp_float8_all_gather=all_gather, unavailable=unavailable,
                            experts_unavailable=experts_unavailable,
                            format=resolve_format(f8.recipe, f8.format),
                            exclude_fqns=tuple(f8.exclude_fqns), emulate=f8.emulate, require=f8.require,
                            moe_experts=f8.moe_experts, expert_weights_per_step=_keep_expert_weights(cfg, pd),
                            weights_per_step=_weights_per_step(cfg, pd, all_gather=all_gather),
                            kept_weight_numel=sum(m.weight.numel() for fqn, m in shapes.named_modules()
                                                  if fqn in converted),
                            delayed=DelayedScalingSettings(f8.amax_history_len, f8.amax_compute_algo, f8.margin)
                            if f8.scaling == "delayed" else None, save_fp8_activations=f8.save_fp8_activations,
                            bf16_blocks=tuple(bf16_blocks.items()), forward=f8.forward, backward=f8.backward)
    fates = {fqn: UNAVAILABLE if unavailable else "converted" for fqn in converted} | excluded
    by_shape = [f"{fqn} ({why.removeprefix('shape ')})" for fqn, why in excluded.items() if why.startswith("shape ")]
    if by_shape and not unavailable:  # a model's own shapes can leave projections out of FP8: never silent
        logger.warning("FP8: %d Linear layers stay %s because of their shapes (FP8 GEMMs need dimensions divisible by "
                       "16%s): %s%s; fp8_layers.json lists every layer", len(by_shape), "bf16",
                       ", by 128 for blockwise" if f8.recipe == "blockwise" else "", ", ".join(by_shape[:3]),
                       f" and {len(by_shape) - 3} more" if len(by_shape) > 3 else "")
    return options, {fqn: fates[fqn] for fqn, _ in shapes.named_modules() if fqn in fates}


def check_float8_exclusions(cfg: JobConfig, args: ModelArgs) -> None:
    """float8.exclude_fqns on a run that is not fp8: each entry must still name a Linear (docs/fp8.md calls a
    typo an error; caught here before a switch to fp8 or a precision schedule's fp8 phase trips on it)."""
    resolve_bf16_blocks(cfg, args.n_layers)  # the same bounds as an fp8 run's (a schedule's fp8 phase would trip)
    if not cfg.float8.exclude_fqns:
        return
    with torch.device("meta"):
        shapes = build_model(args)
    try:
        select_float8_linears(shapes, exclude_fqns=list(cfg.float8.exclude_fqns))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _repeated(cfg: JobConfig, pd: ParallelDims) -> bool:
    """Does a layer's forward run more than once per optimizer step (microbatches, or the recompute)?"""
    t = cfg.train
    return t.grad_accum_steps > 1 or pd.pp > 1 or t.activation_checkpointing != "none"


def _keep_expert_weights(cfg: JobConfig, pd: ParallelDims) -> bool:
    """Whether the FP8 expert weights are kept through the optimizer step (moe_fp8.Fp8ExpertWeights): where a
    layer's forward runs more than once per step (float8.weights_per_step='auto'; 'on': always) and FSDP2 does not
    shard the experts (apply_fsdp shards them over the expert mesh under ep, else over all of fsdp; a kept copy
    would pin them unsharded)."""
    expert_fsdp = pd.fsdp_shard // pd.ep if pd.ep > 1 else pd.fsdp_shard
    wanted = {"auto": _repeated(cfg, pd), "on": True, "off": False}[cfg.float8.weights_per_step]
    return wanted and expert_fsdp == 1


def _linears_by_default(pd: ParallelDims) -> bool:
    """Whether float8.weights_per_step='auto' keeps the Linears' casts (the routed experts' rule is older and
    measured): under pipeline parallelism only. Measured on 2x H200 (docs/fp8.md#fp8-weights-cast-once-per-step), 8B
    shapes x 16 layers, pp=2, 8 microbatches: 1F1B 1.020x and 1.025x in two calls, for +1.8 GiB per pipeline rank's
    converted weights (x 2-3 with the microbatches in flight, the memory plan's row). On one GPU kept casts made 8B
    shapes x 8 layers 0.94x (one microbatch) and 0.98x (four microbatches of accumulation) for +4.23 GiB: not there;
    'on' opts in."""
    return pd.pp > 1


def _weights_per_step(cfg: JobConfig, pd: ParallelDims, *, all_gather: bool) -> int:
    """float8.weights_per_step for the Linears: the forwards per step that share each weight's one FP8 cast (0: off;
    trainer.parallel.float8.weights_per_step says where it can run and why)."""
    f8, t = cfg.float8, cfg.train
    why_not = next((why for why, bad in (
        (f"float8.recipe='{f8.recipe}' (its forward and input-gradient GEMMs cast the weight along different dims: "
         "tensorwise and blockwise only)", f8.recipe not in ("tensorwise", "blockwise")),
        (f"float8.forward='{f8.forward}', float8.backward='{f8.backward}' (a bf16 GEMM multiplies the bf16 weight)",
         "bf16" in (f8.forward, f8.backward)),
        (f"distributed.dp_shard x cp = {pd.fsdp_shard}: FSDP2 shards the weights and gathers them per microbatch "
         "(float8.enable_fsdp_float8_all_gather casts the shards)", pd.fsdp_shard > 1),
        ("float8.enable_fsdp_float8_all_gather (the weights arrive cast)", all_gather)) if bad), None)
    if f8.weights_per_step == "off" or (f8.weights_per_step == "auto" and (why_not or not _repeated(cfg, pd)
                                                                           or not _linears_by_default(pd))):
        return 0
    if why_not:
        raise ConfigError(f"float8.weights_per_step='on' cannot run with {why_not}: set it 'auto' (or 'off')")
    return t.grad_accum_steps * (t.batch_size // cfg.distributed.pp_microbatch_size if pd.pp > 1 else 1)


def experts_outside_fsdp(cfg: JobConfig, pd: ParallelDims) -> bool:
    """Whether FSDP2 leaves the routed experts out (FSDPOptions.experts_outside, trainer.parallel.fsdp): expert
    parallelism over the whole shard group (ParallelDims.expert_fsdp == 1, no tp) with the master weights already in
    the compute dtype. A unit over one rank shards and reduces nothing, yet copies each layer's experts before the
    forward (FSDP2's one-rank all-gather) and casts, concatenates, divides and copies their gradients after the
    backward: on 2x H200, moe_16b at ep=2, ~2 ms of host time a layer and 3.6 GiB of copies, and its hooks cut the
    compiled block in five graphs (docs/benchmarks/2026-11-29-experts-out-of-fsdp-2x-h200.md). With fp32 master
    weights under bf16 compute the unit stays: it casts them."""
    compute = _COMPUTE_DTYPE[cfg.train.mixed_precision] or torch.float32
    master = torch.bfloat16 if uses_bf16_master(cfg) else torch.float32
    return pd.ep > 1 and pd.tp == 1 and pd.expert_fsdp == 1 and compute == master


def uses_bf16_master(cfg: JobConfig) -> bool:
    """distributed.master_dtype resolved: 'auto' is bf16 for bf16 and fp8 compute, fp32 for fp32 and fp16."""
    d = cfg.distributed
    return d.master_dtype == "bf16" or (d.master_dtype == "auto" and cfg.train.mixed_precision in ("bf16", "fp8"))


# train.attention_backend -> SDPBackend names in order of preference; "auto" on a GPU: cuDNN's kernel first (1.86x
# flash's fwd+bwd at Llama 3 8B shapes, 1x H100: docs/benchmarks.md), then the rest in torch's order.
_ATTENTION_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                       "math": "MATH"}


def resolve_attention_backends(backend: str, *, cuda: bool) -> tuple[str, ...]:
    if backend == "auto":
        return tuple(_ATTENTION_BACKENDS.values()) if cuda else ()
    if backend in ("cudnn", "efficient") and not cuda:
        raise ConfigError(f"train.attention_backend={backend!r} is a GPU kernel and this machine has no GPU; use "
                          "'auto' (torch's choice on a CPU), 'flash' or 'math'")
    return (_ATTENTION_BACKENDS[backend],)


# fp8: e4m3, its scale this step's amax over the ranks (why not e5m2: trainer/parallel/fp8_reduce.py).
_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def resolve_fsdp(cfg: JobConfig, pd: ParallelDims, *, bf16_master: bool, ranks_per_node: int,
                 keep_gathered_fits: bool = True) -> FSDPOptions:
    """FSDP2's policy, its automatic choices made (docs/distributed.md#fsdp2s-automatic-choices).

    keep_gathered_fits: False when the memory plan with every block's weights kept gathered exceeds the device
    (trainer.validate.validate_job tries it first): reshard_after_forward='default' then reshards.
    """
    t, d = cfg.train, cfg.distributed
    # Gradients are summed over ranks (dp, cp, tp) or over microbatches (accumulation; a pipeline's microbatches):
    # FSDP2 sums them in reduce_dtype.
    reduces = pd.dp * pd.cp * pd.tp > 1 or t.grad_accum_steps > 1 or pd.pp > 1
    # Resharding frees the gathered copy between forward and backward for a second all-gather in backward: twice the
    # gather bytes, casts and SM time (dp_shard=2, 2x H200: 3% of the step), for memory. With one rank per shard
    # group it frees nothing; under PP every microbatch would gather again. So the default keeps the weights
    # (ZeRO-2) wherever they fit, and reshards (ZeRO-3) where they do not.
    if d.reshard_after_forward == "default":
        reshard = pd.fsdp_shard > 1 and pd.pp == 1 and not keep_gathered_fits
    else:
        reshard = d.reshard_after_forward == "always"
    compute = _COMPUTE_DTYPE[t.mixed_precision]
    summed_ranks = pd.dp * pd.cp  # ranks whose gradients FSDP2 sums (HSDP's replicas included)
    if d.reduce_dtype != "auto":
        reduce_dtype = _REDUCE_DTYPES[d.reduce_dtype]
    elif not reduces:
        # Nothing to sum: FSDP2 would still cast up and back down around its one-rank reduce-scatter (15 ms a step
        # at 8B shapes x 8 layers, 1x H100), so the compute dtype stays.
        reduce_dtype = compute or torch.float32
    elif bf16_master and summed_ranks <= 2:
        # FSDP2 rounds the reduced gradient to the master dtype and accumulates microbatches in it: with bf16 master
        # weights the sum of two ranks' bf16 gradients, halved, is rounded once either way, so bf16 equals fp32 bit
        # for bit (tests/distributed/test_reduce_dtype.py) at half the bytes and no casts. More ranks: fp32, whose
        # single rounding bf16's partial sums would not match, until a parity run measures them.
        reduce_dtype = torch.bfloat16
    else:
        reduce_dtype = torch.float32
    return FSDPOptions(param_dtype=compute, reduce_dtype=reduce_dtype, reduces=reduces,
                       master_dtype=torch.bfloat16 if bf16_master else torch.float32, reshard_after_forward=reshard,
                       experts_outside=experts_outside_fsdp(cfg, pd))


def describe_fsdp_choices(cfg: JobConfig, pd: ParallelDims, build: BuildOptions, *, ranks_per_node: int) -> str:
    """One startup line: what FSDP2's automatic choices picked and why ("" with one rank per shard group, where
    none of them applies). docs/distributed.md#fsdp2s-automatic-choices has the measurements behind the rules."""
    d, fsdp = cfg.distributed, build.fsdp
    if pd.fsdp_shard == 1 and pd.dp_replicate == 1:
        return ""
    one_node = shard_group_on_one_node(pd, ranks_per_node)
    where = (f"the shard group of {pd.fsdp_shard} ranks is on one machine" if one_node
             else f"the shard group of {pd.fsdp_shard} ranks spans machines of {ranks_per_node} ranks")
    parts = []
    if d.reshard_after_forward == "default" and pd.pp == 1 and pd.fsdp_shard > 1:
        parts.append("weights kept gathered from forward to backward (ZeRO-2; they fit)" if not fsdp.reshard_after_forward
                     else "weights resharded after forward (ZeRO-3; kept gathered they would not fit the GPU)")
    if build.float8 is not None and cfg.float8.enable_fsdp_float8_all_gather == "auto" and cfg.float8.recipe == "tensorwise":
        parts.append("float8 weights all-gathered in fp8" if build.float8.enable_fsdp_float8_all_gather
                     else "float8 weights all-gathered in bf16, cast after the gather")
    summed = pd.dp * pd.cp
    if d.reduce_dtype == "auto" and fsdp.reduces:
        dtype = str(fsdp.reduce_dtype).removeprefix("torch.")
        why = {"bfloat16": f"bf16 master weights summed over {summed} rank{'s' * (summed > 1)}: equal to fp32, half "
                           "the bytes",
               "float32": "bf16 would round the sums of more than 2 ranks differently" if fsdp.master_dtype ==
               torch.bfloat16 else "fp32 master weights"}.get(dtype, "")
        parts.append(f"gradients reduced in {dtype}" + (f" ({why})" if why else ""))
    return f"FSDP2 automatic choices ({where}): {'; '.join(parts)}" if parts else ""


def resolve_build(cfg: JobConfig, pd: ParallelDims, float8: Float8Options | None, *, cuda: bool,
                  ranks_per_node: int = 8, keep_gathered_fits: bool = True) -> BuildOptions:
    """What build_parallel_model takes: FP8, AC, compile and the FSDP2 policy (resolve_fsdp)."""
    t, d = cfg.train, cfg.distributed
    bf16_master = uses_bf16_master(cfg)
    if bf16_master and cfg.optimizer.bf16_update == "nearest":
        logger.warning(
            "distributed.master_dtype='bf16' with optimizer.bf16_update='nearest': plain AdamW on bf16 weights "
            "LOSES every update below half a bf16 ulp (~0.2%% of the weight), so small-lr/late-training updates "
            "vanish; use optimizer.bf16_update='stochastic' or 'kahan'"
        )
    reduces = pd.dp * pd.cp * pd.tp > 1 or t.grad_accum_steps > 1 or pd.pp > 1
    if t.compile_model and cfg.model.tie_word_embeddings:
        logger.info("train.compile_model with model.tie_word_embeddings: the blocks are compiled, the final norm, "
                    "tied head and loss run eagerly (they share an FSDP2 unit with the embeddings, whose hooks "
                    "torch.compile cannot trace inside the loss's graph)")
    if cfg.data.document_masking and cuda and not t.compile_model:
        logger.warning("data.document_masking without train.compile_model: FlexAttention runs compiled on its own "
                       "while the blocks run eagerly; set train.compile_model=true for the fused blocks")
    tokens = t.batch_size * t.seq_len
    if t.loss_chunk_tokens >= tokens:
        logger.warning(
            "train.loss_chunk_tokens=%d >= the %d tokens of a microbatch (train.batch_size x train.seq_len): one "
            "chunk, so no memory is saved but the output head still runs again in backward; lower it",
            t.loss_chunk_tokens, tokens,
        )
    return BuildOptions(
        float8=float8,
        ac=ACOptions(mode=t.activation_checkpointing, selective_every=t.selective_ac_every),
        compile=t.compile_model,
        fsdp=resolve_fsdp(cfg, pd, bf16_master=bf16_master, ranks_per_node=ranks_per_node,
                          keep_gathered_fits=keep_gathered_fits),
        loss_parallel=d.loss_parallel,
        attention_backends=resolve_attention_backends(t.attention_backend, cuda=cuda),
        loss_chunk_tokens=t.loss_chunk_tokens,
        seq_len=t.seq_len,
        # The vocabulary-parallel loss (TP) runs eagerly; otherwise the head and loss compile with the blocks.
        compile_loss=t.compile_model and pd.tp == 1 and not cfg.model.tie_word_embeddings,
        document_eos=eos_id(cfg.data.tokenizer) if cfg.data.document_masking else None,
        moe_dispatch_dtype=cfg.moe.dispatch_dtype,
        moe_padded_dispatch=cfg.moe.dispatch == "padded",
        moe_overlap_all_to_all=cfg.moe.overlap_all_to_all and pd.ep > 1 and t.compile_model,
    )


def resolve_data(cfg: JobConfig, *, vocab_size: int, dp: int
                 ) -> tuple[SampleSource, SampleSource | HeldOutMixture | None]:
    """(training source, held-out source or None), opened and checked (headers, tokenizer, token ids). The held-out
    source of a mixture with a validation_path per source is a HeldOutMixture."""
    data, t = cfg.data, cfg.train
    if data.mix:
        source = MixtureSource([MixEntry(name, entry.weight, _mix_source(cfg, i, entry.path, vocab_size=vocab_size))
                                for i, (name, entry) in enumerate(zip(mix_names(data.mix), data.mix))],
                               seq_len=t.seq_len, seed=data.seed, shuffle=data.shuffle)
    else:
        source = build_source(source=data.source, path=data.path, tokenizer=data.tokenizer, seed=data.seed,
                              vocab_size=vocab_size, seq_len=t.seq_len)
    # A step takes batch_size x grad_accum_steps samples on each dp rank; fewer samples than one global
    # batch would repeat them within the step (and a long seq_len on a small file gives few samples).
    needed, have = t.batch_size * t.grad_accum_steps * dp, source.num_samples(t.seq_len)
    if needed > have:
        raise ConfigError(
            f"one step needs a global batch of {needed} samples (train.batch_size={t.batch_size} x "
            f"train.grad_accum_steps={t.grad_accum_steps} x {dp} data-parallel ranks) of train.seq_len={t.seq_len} "
            f"tokens, but {source!r} has {have}; lower train.seq_len or train.batch_size, or give more data"
        )
    samples = SAVED_INTEGERS["dataloader.consumed_samples"]  # the rule a resume holds the samples read to
    if t.steps * needed > samples.high:
        raise ConfigError(
            f"train.steps={t.steps} x a global batch of {needed} samples reads {t.steps * needed:,} samples, more than "
            f"the {samples.high:,} a checkpoint's dataloader.consumed_samples may be (an int64, which every resume "
            "checks): lower train.steps")
    validation = _validation_source(cfg, vocab_size=vocab_size, dp=dp) if cfg.validation.enable else None
    return source, validation


def resolve_tasks(cfg: JobConfig, *, vocab_size: int) -> tuple[TaskRows, ...]:
    """[[validation.tasks]]' files read as data, checked and tokenized with data.tokenizer into rows of train.seq_len
    (trainer.data.tasks); each error names validation.tasks[i].path."""
    v = cfg.validation
    if not (v.enable and v.tasks):
        return ()
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    return tuple(read_task(task.path, name=task.name, key=f"validation.tasks[{i}].path", tokenizer=tokenizer,
                           seq_len=cfg.train.seq_len, vocab_size=vocab_size) for i, task in enumerate(v.tasks))


def _mix_source(cfg: JobConfig, i: int, path: str, *, vocab_size: int, key: str = "path") -> SampleSource:
    """The shards of data.mix[i] (its path or validation_path), checked as data.path's are."""
    return build_source(source="shards", path=path, tokenizer=cfg.data.tokenizer, seed=cfg.data.seed,
                        vocab_size=vocab_size, seq_len=cfg.train.seq_len, path_key=f"data.mix[{i}].{key}")


def absent_shards(cfg: JobConfig) -> list[str]:
    """The config keys whose shard files are not on this machine (data.path or data.mix's, validation.path)."""
    data, v = cfg.data, cfg.validation
    keys = [("data.path", data.path)] if data.source == "shards" and not data.mix else []
    keys += [(f"data.mix[{i}].path", e.path) for i, e in enumerate(data.mix)]
    if v.enable and v.path:
        keys.append(("validation.path", v.path))
    elif v.enable:  # a mixture's held-out set per source (the config checks: each has one)
        keys += [(f"data.mix[{i}].validation_path", e.validation_path) for i, e in enumerate(data.mix)]
    return [f"{key}='{path}'" for key, path in keys if not shard_paths(path)]


def _validation_source(cfg: JobConfig, *, vocab_size: int, dp: int) -> SampleSource | HeldOutMixture:
    v, data, t = cfg.validation, cfg.data, cfg.train
    if data.mix and not v.path:  # one held-out set per source (config checks: every source has one)
        entries = []
        for i, (name, entry) in enumerate(zip(mix_names(data.mix), data.mix)):
            held_out = _mix_source(cfg, i, entry.validation_path, vocab_size=vocab_size, key="validation_path")
            _check_held_out(cfg, held_out, dp=dp, hint=f" or give data.mix[{i}].validation_path more held-out shards")
            entries.append(MixEntry(name, entry.weight, held_out))
        return HeldOutMixture(tuple(entries))
    if v.path:
        source = build_source(source="shards", path=v.path, tokenizer=data.tokenizer, seed=data.seed,
                              vocab_size=vocab_size, seq_len=t.seq_len, path_key="validation.path")
    else:
        source = build_source(source=data.source, path=data.path, tokenizer=data.tokenizer, seed=data.seed,
                              vocab_size=vocab_size, seq_len=t.seq_len, split="validation")
    _check_held_out(cfg, source, dp=dp, hint="" if v.path else " or set validation.path to held-out shards")
    return source


def _check_held_out(cfg: JobConfig, source: SampleSource | HeldOutMixture, *, dp: int, hint: str) -> None:
    """Enough held-out samples for one evaluation; hint: the end of the message, another way to get them."""
    v, t = cfg.validation, cfg.train
    needed, have = v.steps * t.batch_size * dp, source.num_samples(t.seq_len)
    if needed > have:
        raise ConfigError(
            f"validation.steps={v.steps} x train.batch_size={t.batch_size} x {dp} data-parallel ranks needs {needed} "
            f"held-out samples of seq_len {t.seq_len}, but {source!r} has {have}; lower validation.steps"
            + hint
        )


def _check_fp8_experts(cfg: JobConfig, args: ModelArgs, *, probe: bool = True) -> str:
    """float8.moe_experts needs routed experts, shapes the FP8 grouped GEMM takes, and a device that runs it (or
    float8.require unset: then why it cannot run here, and the experts train in bf16; "" where it runs)."""
    f8, key = cfg.float8, f"float8.moe_experts='{cfg.float8.moe_experts}'"
    if not family_of(args).has_router:
        raise ConfigError(f"{key} needs an MoE flavor, but model.flavor={cfg.model.flavor!r} has no routed experts; "
                          "set float8.moe_experts='off'")
    # torch._scaled_grouped_mm: fp8 operand strides are multiples of 16 bytes (rows of dim and of moe_ffn_dim
    # values, in both orientations of each weight).
    for name in ("dim", "moe_ffn_dim"):
        if getattr(args, name) % 16:
            raise ConfigError(f"{key} needs the experts' {name} to be a multiple of 16 (FP8 grouped GEMM alignment), "
                              f"but model.flavor={cfg.model.flavor!r} has {name}={getattr(args, name)}")
    if f8.emulate or not probe:
        return ""
    if not torch.cuda.is_available():
        raise ConfigError(f"{key} on a machine without CUDA needs float8.emulate=true: torch._scaled_grouped_mm "
                          "has no CPU kernel")
    ok, what = fp8_grouped_supported(local_device())
    if not ok and f8.require:
        raise ConfigError(f"{key} with float8.require=true, but {what}; use an H100/H200 or "
                          "float8.moe_experts='off'")
    return "" if ok else what


# What to do instead, when float8.require finds no FP8 kernels for the recipe.
_FP8_HARDWARE_FIX = {
    "blockwise": "use an H100/H200, or float8.recipe='tensorwise' or 'rowwise' (compute capability >= 8.9)",
    "other": "use bf16 or a Hopper/Ada GPU",
}


# The fate fp8_layers.json gives a Linear that would convert where this device has no FP8 matmul of the recipe.
UNAVAILABLE = "not converted: FP8 is unavailable on this device (trains in bf16)"


def _probe_fp8(*, require: bool, emulate: bool, recipe: str) -> str:
    """The one probe (`trainer.parallel.float8.fp8_supported`) on this process's device: "" where FP8 matmuls of the
    recipe run (or are emulated), else why not; float8.require fails here, before any process group exists."""
    if emulate:
        return ""
    device = local_device()
    ok, why = fp8_supported(device, recipe)
    if ok or not require:
        return "" if ok else why
    blockwise = recipe == "blockwise"
    setting = "float8.recipe='blockwise'" if blockwise else "train.mixed_precision='fp8'"
    where = "" if device.type == "cuda" else "there is no CUDA GPU: "
    raise ConfigError(f"{setting} with float8.require=true, but {where}{why}; "
                      f"{_FP8_HARDWARE_FIX['blockwise' if blockwise else 'other']}")


def resolve_batch_warmup(cfg: JobConfig, *, dp: int) -> BatchWarmup:
    """train.batch_size_warmup_tokens' ramp on dp data-parallel ranks (the keys alone: trainer.config.checks). A run
    whose train.steps end inside the ramp is said in a warning (a run trained in parts, a test), not refused."""
    t = cfg.train
    warmup = BatchWarmup.of(batch_size=t.batch_size, seq_len=t.seq_len, grad_accum_steps=t.grad_accum_steps, dp=dp,
                            warmup_tokens=t.batch_size_warmup_tokens, warmup_start=t.batch_size_warmup_start)
    if warmup.tokens and warmup.steps >= t.steps:
        logger.warning("train.batch_size_warmup_tokens=%d ramps the batch over %d steps (%s tokens a microbatch on "
                       "%d data-parallel rank%s), not fewer than train.steps=%d: this run never trains with the "
                       "configured batch", warmup.tokens, warmup.steps, f"{warmup.microbatch_tokens:,}", dp,
                       "s" if dp > 1 else "", t.steps)
    return warmup
