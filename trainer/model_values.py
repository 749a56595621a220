"""The model's arguments (`ModelArgs` with its `RopeScaling`, the MoE family's `MoEArgs`) and the type and range rules
of their values, wherever they come from: the TOML `[model]` and `[moe]` sections (generated from these dataclasses,
trainer/config/model_sections.py), a checkpoint's checkpoint.json, a Hugging Face config.json.

One table (`RULES`), so a value refused in one place is refused in all. A leaf: it imports nothing of the
trainer and not torch (the config is generated and checked from it while it is parsed), and each caller raises
its own error type (ConfigError, CheckpointError, ExportError) with the problem returned here. Sizes have no upper
bound beyond `MAX_INT` here: what a checkpoint's arguments imply is checked against its files' own sizes
(`trainer.models.counts.param_count`), and a training run's against the device (trainer/validate).

The integers a checkpoint saves besides (`SAVED_INTEGERS`: the step, the schedule, the data position, the layout) have
their rules here too, with the config keys they come from (`SAVED_FROM_CONFIG`): a resume checks the saved field and the
config check the key by the same rule, so a run never saves a checkpoint that its relaunch refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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
    """YaRN's frequency scaling of RoPE (transformers' "yarn" rope_type: GPT-OSS, DeepSeek-V3): each frequency
    interpolated by `factor` below the beta_slow rotations over the original context, kept above beta_fast, ramped
    between; cos and sin scaled by the attention factor (0.1 ln(factor) + 1, or DeepSeek's mscale ratio)."""

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
    mscale: float = 0.0
    """With mscale_all_dim: cos and sin times mscale(mscale) / mscale(mscale_all_dim) (DeepSeek's; 0 = unset)."""
    mscale_all_dim: float = 0.0
    """DeepSeek-V3's softmax scale times mscale(mscale_all_dim)^2, mscale(m) = 0.1 m ln(factor) + 1 (0 = unset)."""

    def mscale_of(self, m: float = 1.0) -> float:
        """transformers' get_mscale(factor, m): 0.1 m ln(factor) + 1, or 1 for a factor of at most 1."""
        return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """cos and sin's factor (transformers' `_compute_yarn_parameters`): 1 for DeepSeek-V3's equal mscales."""
        both = self.mscale and self.mscale_all_dim
        return self.mscale_of(self.mscale) / self.mscale_of(self.mscale_all_dim) if both else self.mscale_of()

    @property
    def softmax_factor(self) -> float:
        """DeepSeek-V3's factor on its softmax scale (transformers' `yarn_apply_mscale`); GPT-OSS's takes none."""
        return self.mscale_of(self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


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
    """The MoE family's shape and routing (trainer/models/moe.py): a decoder whose MoE blocks (`is_moe_layer`: after
    the first n_dense_layers, every sparse_step-th, none of dense_layers) route each token to top_k of n_experts."""

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
    sparse_step: int = 1
    """Block i is MoE where (i + 1) % sparse_step = 0, the others dense (Qwen3-MoE's decoder_sparse_step)."""
    dense_layers: tuple[int, ...] = ()
    """More dense blocks, by index from 0, wherever they are (Qwen3-MoE's mlp_only_layers)."""
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
        "n_experts", "moe_ffn_dim", "n_shared_experts", "n_dense_layers", "dense_ffn_dim", "sparse_step",
        "dense_layers")

    def __post_init__(self) -> None:
        # A TOML or JSON list becomes a tuple (the args stay hashable and compare equal whatever their source), in
        # order; its values were checked by RULES before the args were made.
        object.__setattr__(self, "dense_layers", tuple(sorted(self.dense_layers)))

    @property
    def ffn_dim(self) -> int:
        return self.dense_ffn_dim or super().ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        """The one rule of which blocks route (transformers' Qwen3MoeDecoderLayer's, with the leading dense ones)."""
        return i >= self.n_dense_layers and (i + 1) % self.sparse_step == 0 and i not in self.dense_layers

    @property
    def n_moe_layers(self) -> int:
        """How many blocks `is_moe_layer`, in closed form (no loop over n_layers: a crafted one costs nothing)."""
        first, step = min(self.n_dense_layers, self.n_layers), self.sparse_step
        stepped = self.n_layers // step - first // step  # the i in [first, n_layers) with (i + 1) % step == 0
        return stepped - sum(1 for i in set(self.dense_layers) if first <= i < self.n_layers and (i + 1) % step == 0)


@dataclass(frozen=True)
class DeepseekV3Args(MoEArgs):
    """DeepSeek-V3's shape (trainer/models/deepseek_v3.py): MoE blocks with multi-head latent attention (MLA), routing
    by sigmoid scores within the best expert groups, and multi-token prediction modules after the last block.

    `head_dim` is the RoPE width, qk_rope_head_dim (as transformers' DeepseekV3Config.head_dim): the RoPE table's; a
    query head is qk_nope_head_dim + qk_rope_head_dim wide, a value head v_head_dim. n_kv_heads is n_heads (every
    head has its own keys and values, expanded from the shared latent)."""

    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    """Router scores: softmax over experts (DeepSeek-MoE) or a sigmoid per expert (DeepSeek-V3)."""
    route_norm: bool = True
    """Renormalize the chosen top_k scores to sum to 1 (norm_topk_prob)."""
    q_lora_rank: int = 0
    """Rank of the query's low-rank projection (q_a_proj, q_a_layernorm, q_b_proj); 0 = one plain q_proj."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj)."""
    qk_nope_head_dim: int = 128
    """Each query/key head's width without RoPE (from the latent)."""
    qk_rope_head_dim: int = 64
    """Each query head's RoPE part, and the RoPE key's width (one key shared by every head)."""
    v_head_dim: int = 128
    """Each value head's width."""
    n_group: int = 1
    """Expert groups of the group-limited routing (n_experts a multiple of it; 1 = plain top-k)."""
    topk_group: int = 1
    """Groups each token routes within: those with the highest sum of their best two biased scores."""
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' weights (after route_norm)."""
    mtp_layers: int = 0
    """Multi-token prediction modules (DeepSeek-V3 section 2.2): module k predicts the token k + 1 ahead (0 = off)."""
    mtp_loss_weight: float = 0.3
    """Weight of the MTP losses' mean over depths, added to the training loss."""
    rope_yarn: YarnScaling | None = None
    """YaRN scaling of RoPE (the rope_yarn_* keys; its mscale_all_dim scales the softmax too); none: plain RoPE."""

    weight_fields: ClassVar[tuple[str, ...]] = MoEArgs.weight_fields + (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_layers")

    @property
    def head_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    items: Rule | None = None
    """For "list": the rule of each item."""


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
    "mscale": Rule("float", low=0, high=1e6), "mscale_all_dim": Rule("float", low=0, high=1e6),
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
    "sparse_step": Rule("int"),
    "dense_layers": Rule("list", high=100_000, items=Rule("int", low=0)),
    "dense_ffn_dim": Rule("int", low=0),
    "score_func": Rule("choice", choices=("softmax", "sigmoid")),
    "route_norm": Rule("bool"),
    "aux_loss_coef": Rule("float", low=0, high=1e6),
    "bias_update_rate": Rule("float", low=0, high=1e6),
    "capacity_factor": Rule("float", low=0, high=1e6),
    # DeepseekV3Args
    "q_lora_rank": Rule("int", low=0), "kv_lora_rank": Rule("int"), "qk_nope_head_dim": Rule("int"),
    "qk_rope_head_dim": Rule("int"), "v_head_dim": Rule("int"), "n_group": Rule("int"), "topk_group": Rule("int"),
    "routed_scaling_factor": Rule("float", low=0, high=1e6, open_low=True),
    "mtp_layers": Rule("int", low=0),
    "mtp_loss_weight": Rule("float", low=0, high=1e6),
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
        kind = {"str": str, "list": (list, tuple), "dict": dict}[rule.kind]
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        if not isinstance(value, kind):
            what = {"str": "a string", "list": "a list", "dict": "an object"}[rule.kind]
            return f"{key}={shown} must be {what}" + (" (or null)" if rule.optional else "")
        if rule.kind != "dict" and len(value) > rule.high:
            return f"{key} has {len(value):,} {'characters' if rule.kind == 'str' else 'items'}, more than {rule.high:,g}"
        if rule.items is not None:
            return next(filter(None, (rule_problem(rule.items, v, key=f"{key}[{i}]") for i, v in enumerate(value))),
                        None)
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

    if "qk_rope_head_dim" in v:  # MLA: the heads' widths are their own keys (DeepseekV3Args)
        if problem := _mla_problem(v, name):
            return problem
    elif v.get("explicit_head_dim"):
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
    if {"dense_layers", "n_layers"} <= v.keys():
        listed = list(v["dense_layers"])
        if (bad := next((i for i in listed if i >= v["n_layers"]), None)) is not None:
            return f"{keys.get('dense_layers', 'dense_layers')} holds {bad}, not a block of {name('n_layers')}"
        if len(set(listed)) < len(listed):
            return f"{keys.get('dense_layers', 'dense_layers')}={listed} names a block twice"
    return None


def _mla_problem(v: Mapping[str, Any], name: Callable[[str], str]) -> str | None:
    """The combinations of DeepseekV3Args' own fields (MLA, group-limited routing)."""
    if v["qk_rope_head_dim"] % 2:
        return f"{name('qk_rope_head_dim')} must be even (RoPE rotates pairs of dimensions)"
    if {"n_experts", "n_group", "topk_group"} <= v.keys():
        if v["n_experts"] % v["n_group"] or (v["n_group"] > 1 and v["n_experts"] // v["n_group"] < 2):
            return (f"{name('n_experts')} must be a multiple of {name('n_group')} with at least 2 experts per group "
                    "(a group is ranked by its best two scores)")
        if v["topk_group"] > v["n_group"]:
            return f"{name('topk_group')} must be at most {name('n_group')}"
        if "top_k" in v and v["top_k"] > v["topk_group"] * (v["n_experts"] // v["n_group"]):
            return (f"{name('top_k')} must be at most the experts of {name('topk_group')} groups "
                    f"({v['topk_group'] * (v['n_experts'] // v['n_group'])})")
    return None


# The smallest dtype a model's weights are stored in (bfloat16, float16): its files hold at least 2 bytes per parameter.
MIN_BYTES_PER_PARAM = 2
EDITED = "not as this trainer writes it: an edited or foreign file"


def size_text(n: float) -> str:
    """A byte count for a message: GiB, MiB or bytes."""
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{int(n):,} bytes"
