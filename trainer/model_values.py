"""The model's arguments (`ModelArgs` with its `RopeScaling`, the MoE family's `MoEArgs`) and the type and range rules
of their values, wherever they come from: the TOML `[model]` and `[moe]` sections (generated from these dataclasses,
trainer/config/model_sections.py), a checkpoint's checkpoint.json, a Hugging Face config.json.

One table (`RULES`), so a value refused in one place is refused in all. A leaf: it imports nothing of the
trainer and not torch (the config is generated and checked from it while it is parsed), and each caller raises
its own error type (ConfigError, CheckpointError, ExportError) with the problem returned here. Sizes have no upper
bound beyond `MAX_INT` here: what a checkpoint's arguments imply is checked against its files' own sizes
(`param_count`), and a training run's against the device (trainer/validate).

The integers a checkpoint saves besides (`SAVED_INTEGERS`: the step, the schedule, the data position, the layout) have
their rules here too, with the config keys they come from (`SAVED_FROM_CONFIG`): a resume checks the saved field and the
config check the key by the same rule, so a run never saves a checkpoint that its relaunch refuses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

# No model has a dimension or count this large; it keeps the arithmetic on them (ffn_dim's float rule) exact.
MAX_INT = 2**40
# The longest RoPE table a checkpoint or config may ask for (16M positions; 128K is the longest flavor's).
MAX_SEQ_LEN = 2**24


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency scaling of RoPE, for long context (transformers' "llama3" rope_type)."""

    kind: ClassVar[str] = "llama3"
    factor: float = 8.0
    """Llama 3 RoPE scaling factor (8 for 3.1, 32 for 3.2)."""
    low_freq_factor: float = 1.0
    """Llama 3 RoPE scaling low_freq_factor."""
    high_freq_factor: float = 4.0
    """Llama 3 RoPE scaling high_freq_factor."""
    original_max_seq_len: int = 8192
    """The context the scaled RoPE was trained at."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's frequency scaling of RoPE (transformers' "yarn" rope_type, GPT-OSS): each frequency interpolated by
    `factor` below the beta_slow rotations over the original context, kept above beta_fast, ramped between; cos and
    sin scaled by 0.1 ln(factor) + 1 (the attention factor)."""

    kind: ClassVar[str] = "yarn"
    factor: float = 32.0
    """YaRN scaling factor (the new context over the original)."""
    beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """Rotations over the original context below which a frequency is divided by factor (interpolated)."""
    original_max_seq_len: int = 4096
    """The context the scaled RoPE was trained at (original_max_position_embeddings)."""
    truncate: bool = False
    """Round the ramp's ends to whole dimensions (transformers' default true; GPT-OSS false)."""

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' get_mscale(factor))."""
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelArgs:
    """A decoder's shape: every family's (trainer/models/layers.py builds from it)."""

    dim: int
    """Hidden size (the residual stream's width)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention (query) heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention; n_heads must be a multiple)."""
    vocab_size: int
    """Vocabulary size."""
    multiple_of: int = 256
    """ffn_dim is rounded up to a multiple of this when derived from dim."""
    ffn_dim_multiplier: float | None = None
    """A factor on Llama's 8/3 x dim when ffn_dim is derived (1.3 for Llama 3 8B; none is 1)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's long-context frequency scaling of RoPE (the rope_scaling_* keys); none: plain RoPE."""
    max_seq_len: int = 8192
    """Positions of the RoPE table."""
    explicit_head_dim: int = 0
    """Each attention head's width, even (RoPE rotates pairs); 0 = dim // n_heads (Qwen3 sets it apart from dim)."""
    explicit_ffn_dim: int = 0
    """The MLP's hidden width; 0 = Llama's rule from dim, ffn_dim_multiplier and multiple_of."""
    tie_word_embeddings: bool = False
    """The output head is the embedding table (one parameter): small models, SmolLM2, Qwen3-0.6B."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before RoPE (Qwen3, OLMo 2): `attention.q_norm`, `attention.k_norm`."""

    # The fields that size a weight (a checkpoint's model fixes them); the others change what the model computes.
    weight_fields: ClassVar[tuple[str, ...]] = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                "explicit_head_dim", "explicit_ffn_dim", "tie_word_embeddings",
                                                "qk_norm")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.explicit_ffn_dim:
            return self.explicit_ffn_dim
        # Llama's rule: 2/3 of 4*dim, scaled, rounded up to multiple_of.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    """The MoE family's shape and routing (trainer/models/moe.py): a decoder whose blocks after the first
    n_dense_layers route each token to top_k of n_experts."""

    n_experts: int = 8
    """Routed experts per MoE block."""
    top_k: int = 2
    """Experts each token is routed to."""
    moe_ffn_dim: int = 256
    """Hidden width of each routed (and shared) expert."""
    n_shared_experts: int = 0
    """Shared experts every token passes through (0 = none), run as one MLP of n_shared_experts x moe_ffn_dim."""
    n_dense_layers: int = 0
    """Leading blocks that are dense (an MLP of dense_ffn_dim) instead of MoE."""
    dense_ffn_dim: int = 0
    """Hidden width of the dense blocks' MLP; 0 = Llama's rule from dim."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (DeepSeek-MoE) or a sigmoid per expert (DeepSeek-V3)."""
    route_norm: bool = False
    """Renormalize the chosen top_k scores to sum to 1."""
    aux_loss_coef: float = 0.0
    """Weight of the sequence-wise load-balancing loss added to the LM loss (0 = off)."""
    bias_update_rate: float = 0.0
    """Step of the aux-loss-free expert bias update after each optimizer step (0 = off)."""
    capacity_factor: float = 0.0
    """Per-sequence expert capacity as a multiple of the balanced share; tokens over it are dropped (0 = none)."""

    weight_fields: ClassVar[tuple[str, ...]] = ModelArgs.weight_fields + (
        "n_experts", "moe_ffn_dim", "n_shared_experts", "n_dense_layers", "dense_ffn_dim")

    @property
    def ffn_dim(self) -> int:
        return self.dense_ffn_dim or super().ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.n_dense_layers


@dataclass(frozen=True)
class GptOssArgs(MoEArgs):
    """GPT-OSS (trainer/models/gpt_oss.py): an MoE decoder whose attention has q/k/v/o biases, a learned sink logit per
    head and a sliding window on some layers, whose experts have biases and a clamped SwiGLU, whose router has a
    bias, and whose RoPE is YaRN-scaled. Routing: softmax over the top_k logits (= score_func "softmax" with
    route_norm)."""

    sliding_window: int = 128
    """Keys each query of a sliding-window layer sees, itself included (0: every layer attends to the whole
    sequence)."""
    full_attention_interval: int = 2
    """Layer i attends to the whole sequence when (i + 1) is a multiple of this, else to its sliding window
    (transformers' default layer_types: sliding, full, sliding, ...; 1 = every layer full)."""
    swiglu_alpha: float = 1.702
    """The experts' SwiGLU gate: gate * sigmoid(swiglu_alpha * gate)."""
    swiglu_limit: float = 7.0
    """The experts' clamp: gate to at most this, up to [-limit, limit], before (up + 1) * glu."""
    rope_yarn: YarnScaling | None = None
    """YaRN scaling of RoPE (the rope_yarn_* keys); none: plain RoPE."""

    weight_fields: ClassVar[tuple[str, ...]] = MoEArgs.weight_fields

    def is_sliding(self, i: int) -> bool:
        return self.sliding_window > 0 and (i + 1) % self.full_attention_interval != 0


@dataclass(frozen=True)
class Rule:
    kind: str  # "int", "float", "bool", "choice"; for the checkpoint files' tables also "str", "list", "dict"
    low: float = 1
    """The least value (inclusive); for floats with `open_low`, exclusive."""
    high: float = MAX_INT
    """The largest value; for "str" and "list" the most characters or items (the work a file can cause)."""
    open_low: bool = False
    optional: bool = False
    """None is allowed (ffn_dim_multiplier, rope_scaling)."""
    choices: tuple[str, ...] = ()


RULES: dict[str, Rule] = {
    "dim": Rule("int"),
    "n_layers": Rule("int"),
    "n_heads": Rule("int"),
    "n_kv_heads": Rule("int"),
    "vocab_size": Rule("int"),
    "ffn_dim": Rule("int"),
    "multiple_of": Rule("int"),
    "ffn_dim_multiplier": Rule("float", low=0, high=1e6, open_low=True, optional=True),
    "norm_eps": Rule("float", low=0, high=1, open_low=True),
    # Above 1: RoPE rotates dimension pair k by theta^(-2k/head_dim) per position; a base at or below 1 gives every
    # pair the same (or a growing, quickly infinite) frequency.
    "rope_theta": Rule("float", low=1, high=1e30, open_low=True),
    "max_seq_len": Rule("int", high=MAX_SEQ_LEN),
    "explicit_head_dim": Rule("int", low=0),
    "explicit_ffn_dim": Rule("int", low=0),
    "tie_word_embeddings": Rule("bool"),
    "qk_norm": Rule("bool"),
    # RopeScaling
    "factor": Rule("float", low=0, high=1e6, open_low=True),
    "low_freq_factor": Rule("float", low=0, high=1e6, open_low=True),
    "high_freq_factor": Rule("float", low=0, high=1e6, open_low=True),
    "original_max_seq_len": Rule("int", high=MAX_SEQ_LEN),
    # YarnScaling (factor, original_max_seq_len: RopeScaling's rules)
    "beta_fast": Rule("float", low=0, high=1e6, open_low=True),
    "beta_slow": Rule("float", low=0, high=1e6, open_low=True),
    "truncate": Rule("bool"),
    # GptOssArgs
    "sliding_window": Rule("int", low=0, high=MAX_SEQ_LEN),
    "full_attention_interval": Rule("int"),
    "swiglu_alpha": Rule("float", low=0, high=1e6, open_low=True),
    "swiglu_limit": Rule("float", low=0, high=1e6, open_low=True),
    # MoEArgs
    "n_experts": Rule("int"),
    "top_k": Rule("int"),
    "moe_ffn_dim": Rule("int"),
    "n_shared_experts": Rule("int", low=0),
    "n_dense_layers": Rule("int", low=0),
    "dense_ffn_dim": Rule("int", low=0),
    "score_func": Rule("choice", choices=("softmax", "sigmoid")),
    "route_norm": Rule("bool"),
    "aux_loss_coef": Rule("float", low=0, high=1e6),
    "bias_update_rate": Rule("float", low=0, high=1e6),
    "capacity_factor": Rule("float", low=0, high=1e6),
}


# A count a checkpoint saves (the step, the scheduler's position, the samples read) is an int64 in every consumer: the
# scheduler, the metrics, the data loader's numpy arithmetic.
MAX_COUNTER = 2**63 - 1
COUNTER = Rule("int", low=0, high=MAX_COUNTER)
# The integers of a checkpoint's state.json and checkpoint.json (its `layout`), each with the rule every load checks it
# by (trainer/checkpoint/values.py builds its tables from this one). LambdaLR counts its construction as a step, so its
# `_step_count` is the position + 1: at most train.steps + 1.
SAVED_INTEGERS: dict[str, Rule] = {
    "train_state.step": COUNTER,
    "lr_scheduler.last_epoch": COUNTER,
    "lr_scheduler._step_count": Rule("int", low=0, high=MAX_COUNTER + 1),
    "lr_scheduler.schedule.warmup_steps": COUNTER,
    "lr_scheduler.schedule.total_steps": COUNTER,
    **{f"dataloader.{k}": COUNTER for k in ("consumed_samples", "seq_len", "global_batch_size", "num_samples")},
    "loss_scaler.good_steps": COUNTER,
    "layout.*": Rule("int", low=1, high=2**31),
}
# The config keys whose value a checkpoint saves, or bounds a saved count by: trainer/config/checks.py holds each to
# the rule of the fields it becomes, so no run saves a checkpoint that its relaunch refuses. The samples read are
# train.steps x the global batch, checked once the world size is known (trainer/validate/resolve.py); data.seed keeps
# the range of trainer/seeds.py, which the checkpoint's `dataloader.seed` rule takes too.
SAVED_FROM_CONFIG: dict[str, tuple[str, ...]] = {
    "train.steps": ("train_state.step", "lr_scheduler.last_epoch", "lr_scheduler.schedule.total_steps",
                    "loss_scaler.good_steps"),
    "scheduler.warmup_steps": ("lr_scheduler.schedule.warmup_steps",),
    "train.seq_len": ("dataloader.seq_len",),
    **{f"distributed.{k}": ("layout.*",) for k in ("dp_replicate", "tp", "ep", "pp", "cp")},
}


def saved_problem(key: str, value: Any) -> str | None:
    """What is wrong with the config key `key` = `value` by the rules of the checkpoint fields it becomes, or None."""
    for field in SAVED_FROM_CONFIG.get(key, ()):
        if problem := rule_problem(SAVED_INTEGERS[field], value, key=key):
            saved_as = field.replace("*", key.rpartition(".")[2])  # layout.* -> layout.tp
            return f"{problem}: a checkpoint saves it as {saved_as}, which every resume holds to that range"
    return None


def value_problem(field: str, value: Any, *, key: str | None = None, zero_keeps: str = "") -> str | None:
    """What is wrong with `value` for the model argument `field` ("key=value must be ..."), or None.

    `key` names it in the message (default: the field); `zero_keeps`: 0 is allowed and means that
    (the TOML overrides, where 0 keeps the flavor's own).
    """
    return rule_problem(RULES[field], value, key=key or field, zero_keeps=zero_keeps)


def rule_problem(rule: Rule, value: Any, *, key: str, zero_keeps: str = "") -> str | None:
    """What is wrong with `value` for `rule` ("key=value must be ..."), or None: a value of a model argument, or one
    field of a checkpoint's JSON files (trainer/checkpoint/values.py walks those with their own tables)."""
    if value is None and rule.optional:
        return None
    if rule.kind in ("str", "list", "dict"):
        kind = {"str": str, "list": list, "dict": dict}[rule.kind]
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        if not isinstance(value, kind):
            what = {"str": "a string", "list": "a list", "dict": "an object"}[rule.kind]
            return f"{key}={shown} must be {what}" + (" (or null)" if rule.optional else "")
        if rule.kind != "dict" and len(value) > rule.high:
            return f"{key} has {len(value):,} {'characters' if rule.kind == 'str' else 'items'}, more than {rule.high:,g}"
        return None
    if rule.kind == "bool":
        return None if isinstance(value, bool) else f"{key}={value!r} must be true or false"
    if rule.kind == "choice":
        return None if value in rule.choices else f"{key}={value!r} must be one of {', '.join(map(repr, rule.choices))}"
    zero = f", or 0 for {zero_keeps}" if zero_keeps else ""
    if rule.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key}={value!r} must be an integer" + (" (or null)" if rule.optional else "")
        if zero_keeps and value == 0:
            return None
        if not rule.low <= value <= rule.high:
            return f"{key}={value} must be an integer in [{rule.low:g}, {rule.high}]{zero}"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key}={value!r} must be a number" + (" (or null)" if rule.optional else "")
    low_ok = value > rule.low if rule.open_low else value >= rule.low
    if not (math.isfinite(value) and low_ok and value <= rule.high):
        return f"{key}={value!r} must be in {'(' if rule.open_low else '['}{rule.low:g}, {rule.high:g}]"
    return None


def values_problem(values: Mapping[str, Any], *, keys: Mapping[str, str] | None = None) -> str | None:
    """The first problem with these model arguments (each field with a rule, then the combinations), or None.

    `values`: field -> value (ModelArgs fields, ffn_dim, and rope_scaling as a dict or None); fields
    without a rule are not looked at. `keys`: field -> the name the source gives it (config.json's keys).
    """
    keys = keys or {}
    for field, value in values.items():
        if field in ("rope_scaling", "rope_yarn"):
            if value is None:
                continue
            if not isinstance(value, Mapping):
                return f"{keys.get(field, field)}={value!r} must be an object (or null)"
            inner = {k: v for k, v in value.items() if k in RULES}
            if problem := values_problem(inner, keys={k: f"{keys.get(field, field)}.{k}" for k in inner}):
                return problem
        elif field in RULES and (problem := value_problem(field, value, key=keys.get(field))):
            return problem
    return _combination_problem(values, keys)


def _combination_problem(v: Mapping[str, Any], keys: Mapping[str, str]) -> str | None:
    def name(field: str) -> str:
        return f"{keys.get(field, field)}={v[field]}"

    if v.get("explicit_head_dim"):
        if v["explicit_head_dim"] % 2:
            return f"{name('explicit_head_dim')} must be even (RoPE rotates pairs of dimensions)"
    elif {"dim", "n_heads"} <= v.keys() and (v["dim"] % v["n_heads"] or (v["dim"] // v["n_heads"]) % 2):
        return (f"{name('dim')} must be an even multiple of {name('n_heads')} (an even head_dim, for RoPE), or set "
                f"{keys.get('explicit_head_dim', 'explicit_head_dim')}")
    if {"n_heads", "n_kv_heads"} <= v.keys() and v["n_heads"] % v["n_kv_heads"]:
        return f"{name('n_heads')} must be a multiple of {name('n_kv_heads')}"
    if {"top_k", "n_experts"} <= v.keys() and v["top_k"] > v["n_experts"]:
        return f"{name('top_k')} must be at most {name('n_experts')}"
    if {"n_dense_layers", "n_layers"} <= v.keys() and v["n_dense_layers"] > v["n_layers"]:
        return f"{name('n_dense_layers')} must be at most {name('n_layers')}"
    return None


def layer_param_counts(args: ModelArgs) -> tuple[int, int, int, int]:
    """Parameters of one block's parts: (attention with both norms, a dense MLP, an MoE layer's shared experts,
    its router gate and routed experts); the last two are 0 for a dense model. An MoE model's ffn_dim is its dense
    blocks' width. The MoE expert-bias buffers are not parameters: param_count adds them."""
    d, hd = args.dim, args.head_dim
    attention = 2 * d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + 2 * d  # q, o; k, v; two norms
    attention += 2 * hd if args.qk_norm else 0
    n_experts = getattr(args, "n_experts", None)
    if n_experts is None:
        return attention, 3 * d * args.ffn_dim, 0, 0
    h = args.moe_ffn_dim
    routed = n_experts * d + 3 * n_experts * h * d
    if isinstance(args, GptOssArgs):  # q/k/v/o biases and the sinks; the router's and the experts' biases
        attention += args.n_heads * hd + 2 * args.n_kv_heads * hd + d + args.n_heads
        routed += n_experts + n_experts * (2 * h + d)
    return attention, 3 * d * args.ffn_dim, 3 * d * args.n_shared_experts * h, routed


def param_count(args: ModelArgs) -> int:
    """Parameters (and MoE expert biases) of a model with these (checked) ModelArgs / MoEArgs, in closed form:
    no loop over layers, so a crafted n_layers costs nothing to count."""
    attention, dense, shared, routed = layer_param_counts(args)
    d = args.dim
    tied = args.tie_word_embeddings  # one table for the embeddings and the head
    total = (1 if tied else 2) * args.vocab_size * d + d + args.n_layers * attention  # + the final norm
    n_experts = getattr(args, "n_experts", None)
    if n_experts is None:
        return total + args.n_layers * dense
    n_dense = min(args.n_dense_layers, args.n_layers)
    return total + n_dense * dense + (args.n_layers - n_dense) * (shared + routed + n_experts)


# The smallest dtype a model's weights are stored in (bfloat16, float16): its files hold at least 2 bytes per parameter.
MIN_BYTES_PER_PARAM = 2
EDITED = "not as this trainer writes it: an edited or foreign file"


def size_text(n: float) -> str:
    """A byte count for a message: GiB, MiB or bytes."""
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{int(n):,} bytes"


def files_fit_problem(args: ModelArgs, *, data_bytes: int, files: str, tied: bool = False) -> str | None:
    """What is wrong when the parameters `args` imply, at 2 bytes each at least, exceed the `data_bytes` its weight
    files (`files`) hold, or None: the bound on every size a checkpoint.json or a config.json gives, checked in closed
    form before anything is built (a crafted n_layers of 1e8 would take as long as its layers to build).

    tied: the files hold the embeddings once for the head too (a tied Hugging Face model, whether or not `args`
    ties them: param_count counts a tied table once).
    """
    n = param_count(args) - (args.vocab_size * args.dim if tied and not args.tie_word_embeddings else 0)
    if n * MIN_BYTES_PER_PARAM <= data_bytes:
        return None
    return (f"the model arguments (dim={args.dim}, n_layers={args.n_layers}, vocab_size={args.vocab_size}) imply "
            f"{n:,} parameters, at least {size_text(n * MIN_BYTES_PER_PARAM)}, but {files} hold "
            f"{size_text(data_bytes)}; the arguments are not this model's ({EDITED})")


def num_tensors(args: ModelArgs) -> int:
    """Model tensors (state-dict entries) of a model with these args, in closed form."""
    n_experts = getattr(args, "n_experts", None)
    norms = 2 if args.qk_norm else 0  # a tied head is still its own entry
    if n_experts is None:
        return 3 + (9 + norms) * args.n_layers
    n_dense = min(args.n_dense_layers, args.n_layers)
    per_moe = 6 + 5 + (3 if args.n_shared_experts else 0) + norms
    if isinstance(args, GptOssArgs):  # + 4 attention biases, the sinks, the router's bias; w13, b13, b2 for w1-w3
        per_moe += 4 + 1 + 1 + 1
    return 3 + (9 + norms) * n_dense + per_moe * (args.n_layers - n_dense)


def num_params_for(args: ModelArgs) -> tuple[int, int]:
    """(parameters, non-embedding parameters) of a model with these args, as `num_params(model)` counts them
    (param_count less the MoE expert-bias buffers): what the startup log prints, without building a model."""
    total = param_count(args)
    n_experts = getattr(args, "n_experts", None)
    if n_experts is not None:
        total -= (args.n_layers - min(args.n_dense_layers, args.n_layers)) * n_experts
    return total, total - args.vocab_size * args.dim
