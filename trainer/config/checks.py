"""Checks on the config alone: values and combinations, each failure one `ConfigError` line naming the key.

`JobConfig.__post_init__` runs `check_config`, so a bad TOML file or override fails while it
is parsed, before anything is built; `trainer.validate.validate_job` adds what needs the world
size, the model's shapes and the data. It imports nothing of the trainer but leaves: the errors,
the precision-schedule syntax (trainer.config.phases), the model-argument rules
(trainer.model_values) and the seed ranges (trainer.seeds), none of which imports torch, so
loading a config (and `--help`) stays torch-free (tests/unit/test_config.py). `cfg` is the sections of a
`trainer.config.JobConfig` being built (trainer.config.job runs `check_config` from its `__post_init__`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import unicodedata
from collections.abc import Iterator
from typing import Any

from trainer.config.phases import schedule_phases
from trainer.config.sections import Sections
from trainer.errors import ConfigError
from trainer.model_values import RULES, SAVED_FROM_CONFIG, saved_problem, value_problem
from trainer.seeds import MAX_DATA_SEED, MAX_TRAIN_SEED


def check_config(cfg: Sections) -> None:
    """Cross-field and range checks on the config alone, in the order a user would fix them."""
    _check_strings(cfg)
    _check_fp8_with_tp(cfg)
    if cfg.train.precision_schedule:
        _check_precision_schedule(cfg)
    _check_ranges(cfg)
    _check_batch_warmup(cfg)
    _check_saved_values(cfg)
    _check_loss_chunking(cfg)
    _check_optimizer(cfg)
    _check_checkpoint_and_master(cfg)
    _check_float8_and_profiling(cfg)
    _check_moe_experts(cfg)
    _check_dispatch_dtype(cfg)
    _check_data(cfg)
    _check_mix(cfg)
    _check_tasks(cfg)
    _check_wandb(cfg)
    _check_seeds(cfg)
    _check_paths(cfg)


def _check_fp8_with_tp(cfg: Sections) -> None:
    t, d = cfg.train, cfg.distributed
    if t.is_fp8 and d.tp > 1 and not t.precision_schedule:  # a schedule overrides mixed_precision
        raise ConfigError(
            "FP8 + Tensor Parallelism is not yet supported: train.mixed_precision='fp8' with "
            f"distributed.tp={d.tp}. Use distributed.tp=1 with FSDP (dp_shard) for FP8, "
            "or keep tp and set train.mixed_precision='bf16'."
        )


def _check_ranges(cfg: Sections) -> None:
    t, d = cfg.train, cfg.distributed
    at_least_one = {
        "train.steps": t.steps,
        "train.batch_size": t.batch_size,
        "train.seq_len": t.seq_len,
        "train.grad_accum_steps": t.grad_accum_steps,
        "metrics.log_freq": cfg.metrics.log_freq,
        "checkpoint.interval": cfg.checkpoint.interval,
        "distributed.dp_replicate": d.dp_replicate,
        "distributed.tp": d.tp,
        "distributed.ep": d.ep,
        "distributed.pp": d.pp,
        "distributed.cp": d.cp,
        "distributed.pp_microbatch_size": d.pp_microbatch_size,
        "distributed.init_timeout_seconds": d.init_timeout_seconds,
    }
    for key, value in at_least_one.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if d.init_timeout_seconds > MAX_TIMEOUT_SECONDS:  # a timedelta (and the collectives' int64 ms) has a limit
        raise ConfigError(f"distributed.init_timeout_seconds={d.init_timeout_seconds} must be at most "
                          f"{MAX_TIMEOUT_SECONDS:,} (a year)")
    _check_model_values(cfg)
    at_least_zero = {
        "train.max_norm": (t.max_norm, " (0 disables clipping)"),
        "train.selective_ac_every": (t.selective_ac_every, ""),
        "train.loss_chunk_tokens": (t.loss_chunk_tokens, " (0 = off)"),
        "scheduler.warmup_steps": (cfg.scheduler.warmup_steps, ""),
        "checkpoint.keep_latest_k": (cfg.checkpoint.keep_latest_k, " (0 keeps all)"),
        "checkpoint.export_interval": (cfg.checkpoint.export_interval, " (0 = off)"),
        "checkpoint.export_keep_latest_k": (cfg.checkpoint.export_keep_latest_k, " (0 keeps all)"),
        "metrics.fp8_stats_freq": (cfg.metrics.fp8_stats_freq, " (0 = off)"),
        "optimizer.weight_decay": (cfg.optimizer.weight_decay, ""),
        "distributed.pp_stages_per_rank": (d.pp_stages_per_rank, " (0 = automatic)"),
        "distributed.pp_layers_per_stage": (d.pp_layers_per_stage, " (0 = automatic)"),
    }
    for key, (value, note) in at_least_zero.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0{note}")
    for key in ("pp_embedding_weight", "pp_head_weight"):
        value = getattr(d, key)
        if value < 0 and value != -1:
            raise ConfigError(f"distributed.{key}={value} must be >= 0 (a cost in blocks), or -1 for its FLOPs")
    if d.dp_shard == 0 or d.dp_shard < -1:
        raise ConfigError(f"distributed.dp_shard={d.dp_shard} must be >= 1, or -1 for the rest of the world size")


def _check_batch_warmup(cfg: Sections) -> None:
    """train.batch_size_warmup_*: the ramp is in whole microbatches of train.batch_size (trainer/data/batch_warmup.py),
    from at least one to fewer than train.grad_accum_steps; a start without tokens would be ignored: refused."""
    t = cfg.train
    tokens, start, final = t.batch_size_warmup_tokens, t.batch_size_warmup_start, t.batch_size * t.grad_accum_steps
    if tokens < 0 or start < 0:
        key, value = ("tokens", tokens) if tokens < 0 else ("start", start)
        raise ConfigError(f"train.batch_size_warmup_{key}={value} must be >= 0 (0 = off)")
    if not tokens:
        if start:
            raise ConfigError(f"train.batch_size_warmup_start={start} has no effect with train.batch_size_warmup_tokens"
                              "=0: set the tokens to ramp the batch over, or drop the start")
        return
    if t.grad_accum_steps < 2:
        raise ConfigError(f"train.batch_size_warmup_tokens={tokens} needs train.grad_accum_steps >= 2: the batch is "
                          "ramped in whole microbatches of train.batch_size sequences (every step the same shapes); "
                          "e.g. halve train.batch_size and set train.grad_accum_steps=2 for the same batch")
    if start < t.batch_size or start % t.batch_size:
        raise ConfigError(f"train.batch_size_warmup_start={start} must be a whole number of microbatches: a positive "
                          f"multiple of train.batch_size={t.batch_size} (sequences per data-parallel rank)")
    if start >= final:
        raise ConfigError(f"train.batch_size_warmup_start={start} must be below the configured batch of {final} "
                          f"sequences per rank (train.batch_size={t.batch_size} x train.grad_accum_steps="
                          f"{t.grad_accum_steps}), which the warm-up ramps up to")


def _check_saved_values(cfg: Sections) -> None:
    """Each key a checkpoint saves (train.steps, scheduler.warmup_steps, ...) by the rule a resume checks the saved
    field by (trainer.model_values.SAVED_FROM_CONFIG): a run that starts never saves what its relaunch refuses."""
    for key in SAVED_FROM_CONFIG:
        section, _, name = key.partition(".")
        if problem := saved_problem(key, getattr(getattr(cfg, section), name)):
            raise ConfigError(problem)


def _check_model_values(cfg: Sections) -> None:
    """Every [model], [moe] and [deepseek_v3] key set by the rules of the model argument it sets (trainer.model_values:
    the same for a checkpoint's and a config.json's); a key left out keeps the flavor's value."""
    for section in ("model", "moe", "deepseek_v3"):
        values = getattr(cfg, section)
        for f in dataclasses.fields(values):
            value, arg = getattr(values, f.name), f.metadata.get("sub", f.metadata.get("field"))
            if value is None or arg not in RULES:
                continue
            if problem := value_problem(arg, value, key=f"{section}.{f.name}"):
                raise ConfigError(f"{problem} (leave {section}.{f.name} out for the flavor's own)")


def _check_loss_chunking(cfg: Sections) -> None:
    t, d = cfg.train, cfg.distributed
    if t.loss_chunk_tokens and d.tp > 1:
        raise ConfigError(
            f"train.loss_chunk_tokens={t.loss_chunk_tokens} with distributed.tp={d.tp}: a chunked loss is not "
            "implemented under tensor parallel (loss_parallel already splits the logits over the tp ranks); "
            "set train.loss_chunk_tokens=0"
        )


def _check_optimizer(cfg: Sections) -> None:
    o, s = cfg.optimizer, cfg.scheduler
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be > 0")
    for key, value in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key}={value} must be in [0, 1)")
    if o.eps <= 0:
        raise ConfigError(f"optimizer.eps={o.eps} must be > 0")
    if not 0 <= s.min_lr_ratio <= 1:
        raise ConfigError(f"scheduler.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    if not 0 < s.wsd_decay_ratio <= 1:
        raise ConfigError(f"scheduler.wsd_decay_ratio={s.wsd_decay_ratio} must be in (0, 1]")
    if cfg.metrics.loss_spike_factor <= 1:
        raise ConfigError(f"metrics.loss_spike_factor={cfg.metrics.loss_spike_factor} must be > 1")
    if (k := cfg.metrics.kurtosis_warn) < 0:  # NaN and infinity: the loader refuses every float that is not finite
        raise ConfigError(f"metrics.kurtosis_warn={k} must be >= 0 (0 = off)")
    if k and not cfg.metrics.fp8_stats_freq:
        raise ConfigError(f"metrics.kurtosis_warn={k} has no effect: the kurtosis is one of the FP8 health stats; set "
                          "metrics.fp8_stats_freq=N (fp8 runs) or metrics.kurtosis_warn=0")


def _check_checkpoint_and_master(cfg: Sections) -> None:
    c = cfg.checkpoint
    if c.load_step < -1:
        raise ConfigError(f"checkpoint.load_step={c.load_step} must be >= 0, or -1 for the latest")
    if c.load_step >= 0 and not c.enable:
        raise ConfigError(f"checkpoint.load_step={c.load_step} needs checkpoint.enable=true")
    if cfg.distributed.master_dtype == "bf16" and cfg.train.mixed_precision == "fp32":  # auto: once it resolves
        raise ConfigError(
            "distributed.master_dtype='bf16' computes with the bf16 weights, so train.mixed_precision='fp32' "
            "would not hold; set train.mixed_precision='bf16' (or 'fp8'), or keep distributed.master_dtype='fp32'"
        )


def _check_float8_and_profiling(cfg: Sections) -> None:
    f8 = cfg.float8
    if f8.format == "hybrid" and f8.recipe != "tensorwise":
        raise ConfigError(f"float8.format='hybrid' (e5m2 gradients) is the tensorwise recipe's; float8.recipe="
                          f"'{f8.recipe}' casts every operand to e4m3: set float8.format='auto' (or 'e4m3')")
    for key, on in (("scaling='delayed'", f8.scaling == "delayed"), ("save_fp8_activations=true", f8.save_fp8_activations)):
        if on and f8.recipe != "tensorwise":
            raise ConfigError(f"float8.{key} is the tensorwise recipe's (one scale per tensor); float8.recipe="
                              f"'{f8.recipe}' scales per row or tile: set float8.recipe='tensorwise'")
    if not 1 <= f8.amax_history_len <= MAX_AMAX_HISTORY_LEN:
        raise ConfigError(f"float8.amax_history_len={f8.amax_history_len} must be in [1, {MAX_AMAX_HISTORY_LEN:,}] "
                          "(each converted Linear keeps three histories of this many fp32 amaxes on the GPU and in "
                          "every checkpoint; Transformer Engine's default is 1024)")
    if not 0 <= f8.margin <= MAX_FLOAT8_MARGIN:
        raise ConfigError(f"float8.margin={f8.margin} must be in [0, {MAX_FLOAT8_MARGIN}] (scale = fp8_max / amax / "
                          "2^margin: beyond 16 even the largest value rounds to zero in e4m3, whose range spans "
                          "2^17.8; 0-2 is usual)")
    if f8.enable_fsdp_float8_all_gather is True and f8.recipe != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather=true only works with float8.recipe='tensorwise' "
            f"(got recipe='{f8.recipe}'); set --float8.enable_fsdp_float8_all_gather=auto (or false)"
        )
    _check_validation_precision(cfg)
    p = cfg.profiling
    if p.enable and not 1 <= p.start_step <= p.end_step:
        raise ConfigError(
            f"profiling.start_step={p.start_step}, profiling.end_step={p.end_step}: the window must satisfy "
            "1 <= start_step <= end_step"
        )
    if p.enable and p.start_step > cfg.train.steps:
        raise ConfigError(f"profiling.start_step={p.start_step} is after the run's last step (train.steps="
                          f"{cfg.train.steps}): the window would record nothing; set profiling.start_step and "
                          f"end_step within 1-{cfg.train.steps}, or profiling.enable=false")


def _check_validation_precision(cfg: Sections) -> None:
    """validation.mixed_precision='bf16' evaluates fp8 matmuls in bf16: it needs bf16 weights on the rank (no fp8
    all-gather) and has nothing to do for an explicit fp32 or fp16 run ('auto' warns once it resolves)."""
    if cfg.validation.mixed_precision != "bf16":
        return
    train = cfg.train
    # The schedule was checked before (check_config's order): its phases parse.
    precisions = ([p.mixed_precision for p in schedule_phases(cfg)] if train.precision_schedule
                  else [train.mixed_precision])
    wide = [p for p in precisions if p in ("fp32", "fp16")]
    if wide:
        key = "train.precision_schedule" if train.precision_schedule else "train.mixed_precision"
        raise ConfigError(f"validation.mixed_precision='bf16' evaluates an fp8 run's matmuls in bf16; {key} trains in "
                          f"{wide[0]}, which it would not evaluate in bf16: set validation.mixed_precision='training'")
    if cfg.float8.enable_fsdp_float8_all_gather is True and any(p in ("fp8", "auto") for p in precisions):
        raise ConfigError("validation.mixed_precision='bf16' needs the bf16 weights, and "
                          "float8.enable_fsdp_float8_all_gather=true gathers float8 ones: set "
                          "float8.enable_fsdp_float8_all_gather='auto' (off with bf16 evaluation) or false")


MAX_TIMEOUT_SECONDS = 365 * 24 * 3600
MAX_AMAX_HISTORY_LEN = 16_384
MAX_FLOAT8_MARGIN = 16
MOE_EXPERTS_MODES = ("off", "rowwise")
# Why float8.moe_experts='blockwise' is refused, in one line.
BLOCKWISE_EXPERTS_REASON = (
    "no Hopper blockwise FP8 grouped GEMM exists in torch 2.11-2.13 (torch._scaled_grouped_mm takes rowwise scales on "
    "sm90) nor in torchao 0.18 (its blockwise grouped GEMM needs the DeepGEMM package, else it emulates)"
)


def _check_moe_experts(cfg: Sections) -> None:
    mode, t = cfg.float8.moe_experts, cfg.train
    if mode == "blockwise":
        raise ConfigError(f"float8.moe_experts='blockwise' is not available: {BLOCKWISE_EXPERTS_REASON}; use 'rowwise'")
    if mode not in MOE_EXPERTS_MODES:
        raise ConfigError(f"float8.moe_experts={mode!r} is not one of {', '.join(map(repr, MOE_EXPERTS_MODES))}")
    fp8_phase = t.precision_schedule and any(p.is_fp8 for p in schedule_phases(cfg))
    if mode != "off" and not t.is_fp8 and not fp8_phase and t.mixed_precision != "auto":  # auto: once it resolves
        raise ConfigError(
            f"float8.moe_experts='{mode}' applies to fp8 runs only, but train.mixed_precision='{t.mixed_precision}' "
            "(a bf16 run keeps every GEMM bf16); set --train.mixed_precision=fp8, or float8.moe_experts='off'"
        )


def _check_dispatch_dtype(cfg: Sections) -> None:
    """moe.dispatch_dtype='fp8' on the config alone; the flavor, ep and dim: trainer.validate.layout."""
    t = cfg.train
    if cfg.moe.dispatch_dtype != "fp8":
        return
    if t.precision_schedule:
        raise ConfigError("moe.dispatch_dtype='fp8' with train.precision_schedule is not supported yet (the dispatch "
                          "dtype would have to follow each phase's precision); set moe.dispatch_dtype='bf16'")
    if not t.is_fp8:
        # A bf16 run could compress its dispatch alone, but it would then move FP8-rounded inputs into bf16 experts
        # for bytes only, a trade no one has measured yet: fp8 dispatch belongs to FP8 training (DeepSeek-V3's).
        raise ConfigError(
            f"moe.dispatch_dtype='fp8' needs train.mixed_precision='fp8', but it is '{t.mixed_precision}' (a "
            "non-FP8 run keeps its tokens in its compute dtype); set --train.mixed_precision=fp8, or "
            "moe.dispatch_dtype='bf16'")


def _check_data(cfg: Sections) -> None:
    v, data = cfg.validation, cfg.data
    if v.enable:
        for key, value in (("validation.freq", v.freq), ("validation.steps", v.steps)):
            if value < 1:
                raise ConfigError(f"{key}={value} must be >= 1")
        if data.source == "shards" and not v.path and not data.mix:  # a mixture: _check_mix
            raise ConfigError("validation.enable=true with data.source='shards' needs validation.path: held-out "
                              "shards made by scripts/prepare_data.py with the same tokenizer")
    for key in ("document_masking", "eod_mask_loss"):
        if getattr(data, key) and data.source == "synthetic":
            raise ConfigError(f"data.{key}=true needs documents separated by EOS tokens, and data.source='synthetic' "
                              f"is random tokens; use another data.source or data.{key}=false")
    if data.source == "shards" and not data.path and not data.mix:
        raise ConfigError("data.source='shards' needs data.path (or data.mix): a folder of .bin shards made by "
                          "scripts/prepare_data.py")
    if data.source in ("default", "stdlib") and data.tokenizer != "byte":
        raise ConfigError(
            f"data.source='{data.source}' is byte-tokenized but data.tokenizer='{data.tokenizer}'; "
            "set data.source='shards' (with data.path) to read shards made with that tokenizer"
        )


def mix_names(mix: list) -> list[str]:
    """Each [[data.mix]] source's name: its own, else its folder's (or glob's parent folder's) name."""
    names = []
    for entry in mix:
        path = entry.path.rstrip("/")
        stem = path.split("/")[-1]
        if any(c in stem for c in "*?["):  # a glob: its folder's name
            stem = path.rsplit("/", 2)[-2] if path.count("/") else stem
        names.append(entry.name or stem)
    return names


MIX_RESOLUTION = 10_000
"""[[data.mix]] weights are kept to 1 part in this many (trainer/data/mix.py): a source's share must be at least one."""


def mix_shares(weights: list[float]) -> list[float]:
    """Each of these finite positive weights' share of their sum. Each is divided by the largest first: a sum of
    weights near the float maximum would overflow to inf and make every share 0."""
    top = max(weights)
    scaled = [w / top for w in weights]
    total = sum(scaled)
    return [w / total for w in scaled]


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _check_mix(cfg: Sections) -> None:
    data, v = cfg.data, cfg.validation
    if not data.mix:
        return
    if data.source != "shards":
        raise ConfigError(f"data.mix holds shard sources, but data.source='{data.source}'; set data.source='shards' "
                          "(or leave it out)")
    if data.path:
        raise ConfigError(f"data.mix replaces data.path; remove data.path='{data.path}' (or data.mix)")
    for i, entry in enumerate(data.mix):
        if not entry.path:
            raise ConfigError(f"data.mix[{i}].path is empty: a folder of .bin shards or a glob")
        if not (entry.weight > 0 and math.isfinite(entry.weight)):
            raise ConfigError(f"data.mix[{i}].weight={entry.weight} must be a positive number (weights are relative)")
    for i, share in enumerate(mix_shares([entry.weight for entry in data.mix])):
        if share < 1 / MIX_RESOLUTION:
            raise ConfigError(f"data.mix[{i}].weight={data.mix[i].weight} is {share:.3g} of the mixture, less than the "
                              f"1 part in {MIX_RESOLUTION:,} it keeps its weights to; raise it or leave the source out")
    names = mix_names(data.mix)
    for i, name in enumerate(names):
        if not name or not set(name) <= _NAME_CHARS:
            raise ConfigError(f"data.mix[{i}].name={name!r} must be letters, digits, '-', '_' or '.' (it names "
                              f"metrics); set data.mix[{i}].name")
        if name in names[:i]:
            raise ConfigError(f"data.mix[{i}] is named {name!r} like data.mix[{names.index(name)}]; give each source "
                              "its own data.mix[].name")
    if v.enable and not v.path:
        missing = [i for i, entry in enumerate(data.mix) if not entry.validation_path]
        if missing:
            raise ConfigError(f"validation.enable=true with data.mix needs validation.path (one held-out set) or a "
                              f"validation_path on every source; data.mix[{missing[0]}] ({names[missing[0]]!r}) has none")


def _check_tasks(cfg: Sections) -> None:
    """[[validation.tasks]] as the config gives them; the validation pass reads their files (trainer.data.tasks)."""
    tasks = cfg.validation.tasks
    if tasks and not cfg.validation.enable:
        raise ConfigError("validation.tasks are scored with the held-out loss: set validation.enable=true (or leave "
                          "validation.tasks out)")
    names = [task.name for task in tasks]
    for i, task in enumerate(tasks):
        if not task.name or not set(task.name) <= _NAME_CHARS:
            raise ConfigError(f"validation.tasks[{i}].name={task.name!r} must be letters, digits, '-', '_' or '.' (it "
                              "names metrics)")
        if task.name in names[:i]:
            first = names.index(task.name)
            raise ConfigError(f"validation.tasks[{i}].name={task.name!r} is validation.tasks[{first}]'s too; give each "
                              "task its own name")
        if not task.path:
            raise ConfigError(f"validation.tasks[{i}].path is empty: a JSON-lines file of multiple-choice items")


def _check_wandb(cfg: Sections) -> None:
    m = cfg.metrics
    if not m.wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.wandb=true needs the wandb package: pip install 'trainer[wandb]' (or set "
                          "metrics.wandb=false)")
    if not m.wandb_project.strip():
        raise ConfigError("metrics.wandb_project is empty; name a W&B project")
    # W&B's own rule (wandb_settings.validate_project), which would otherwise stop the run after the model is built.
    bad = sorted(set(m.wandb_project) & set(_WANDB_PROJECT_FORBIDS))
    if bad or len(m.wandb_project) > 128:
        why = f"holds {', '.join(map(repr, bad))}" if bad else f"has {len(m.wandb_project)} characters"
        raise ConfigError(f"metrics.wandb_project={m.wandb_project[:80]!r} {why}: a W&B project name has at most 128 "
                          f"characters and none of {' '.join(_WANDB_PROJECT_FORBIDS)}; rename it")


_WANDB_PROJECT_FORBIDS = "/\\#?%:"


def _check_seeds(cfg: Sections) -> None:
    # trainer/seeds.py: torch generators take 64 bits, and the init seeds each parameter with
    # train.seed x 1,000,003 + crc32(fqn); numpy's default_rng refuses negative seeds.
    seeds = (
        ("train.seed", cfg.train.seed, MAX_TRAIN_SEED,
         "each parameter's init generator is seeded with train.seed x 1000003 + crc32(fqn), which must fit 64 bits"),
        ("data.seed", cfg.data.seed, MAX_DATA_SEED, "the sample order's generator takes a 64-bit seed >= 0"),
    )
    for key, value, limit, why in seeds:
        if not 0 <= value <= limit:
            raise ConfigError(f"{key}={value} is outside the allowed range [0, {limit}] ({why}); pick a seed in it")


def _check_strings(cfg: Sections) -> None:
    """Every string of every section (list items and [[data.mix]] tables included) is one line of text: no control
    character (a newline, a NUL byte, ...), line separator or undecodable byte. config.toml and resolved.toml record
    each value, the log, W&B and every path call take them; no key documents another rule."""
    for key, text in _strings(dataclasses.asdict(cfg), ""):
        bad = next((c for c in text if unicodedata.category(c) in _NOT_TEXT), None)
        if bad is None:
            continue
        shown = repr(text) if len(repr(text)) <= 80 else repr(text)[:77] + "..."
        if bad == "\x00":
            what = "a NUL byte (\\x00), which no path or name can contain"
        elif unicodedata.category(bad) == "Cs":
            what = f"{bad!r}, a byte the command line's encoding could not decode (config values are UTF-8 text)"
        else:
            what = f"the control character {bad!r} (a config value is one line of text)"
        raise ConfigError(f"{key}={shown} holds {what}; remove it")


# Control characters, surrogates (an undecodable byte of a command line), line and paragraph separators.
_NOT_TEXT = ("Cc", "Cs", "Zl", "Zp")


def _strings(tree: Any, key: str) -> Iterator[tuple[str, str]]:
    """("section.key", text) of every string in the config's dict (dataclasses.asdict)."""
    if isinstance(tree, str):
        yield key, tree
    elif isinstance(tree, dict):
        for name, value in tree.items():
            yield from _strings(value, f"{key}.{name}" if key else name)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _strings(value, f"{key}[{i}]")


def _check_paths(cfg: Sections) -> None:
    if not cfg.job.dump_folder.strip():
        # Path("") is the current directory: config.toml, metrics.jsonl and tb/ would land wherever the run started.
        raise ConfigError(f"job.dump_folder={cfg.job.dump_folder!r} is empty: name the run's output folder "
                          "(e.g. --job.dump_folder=./outputs/run, or '.' for the current directory)")


def _check_precision_schedule(cfg: Sections) -> None:
    t = cfg.train
    if t.steps < 1:
        return  # reported by _check_ranges as train.steps
    phases = schedule_phases(cfg)
    fp8 = [p for p in phases if p.is_fp8]
    if fp8 and cfg.distributed.tp > 1:
        raise ConfigError(
            f"train.precision_schedule has an fp8 phase ({fp8[0]}) but distributed.tp={cfg.distributed.tp}: FP8 + "
            "Tensor Parallelism is not yet supported; use distributed.tp=1 with FSDP (dp_shard), or no fp8 phase"
        )
    if not cfg.checkpoint.enable:
        raise ConfigError(
            "train.precision_schedule needs checkpoint.enable=true: each precision switch saves a checkpoint and the "
            "next phase resumes it (and a relaunch resumes the right phase); set --checkpoint.enable=true"
        )
    p = cfg.profiling
    if p.enable:
        for a, b in zip(phases, phases[1:]):
            if p.start_step <= a.last_step < p.end_step:
                raise ConfigError(
                    f"profiling.start_step={p.start_step}, profiling.end_step={p.end_step}: the window crosses the "
                    f"train.precision_schedule switch {a.precision} -> {b.precision} after step {a.last_step}; "
                    "put it inside one phase"
                )
