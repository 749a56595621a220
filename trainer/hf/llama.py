"""The dense family in Hugging Face's layouts: `LlamaForCausalLM`, and `Qwen3ForCausalLM` for a model with
per-head q/k norms (qk_norm); weight names and config.json.

Our RoPE uses transformers' "rotate half" layout (see trainer/models/layers.py), so
weights map one to one by name, with no permutation of q/k. Any shape either class can
hold maps: another head_dim than hidden_size / num_attention_heads, any intermediate_size,
tied or untied embeddings (a tied folder has no lm_head.weight; importing it fills our head
from embed_tokens, and our tied model holds them as one tensor). What neither our model nor
the mapping has (attention or MLP biases, sliding windows, other RoPE types, other
activations) is refused in one line naming the field. The attention and dense-MLP names and
the RoPE fields of config.json are shared with the MoE family (`trainer.hf.moe`).
"""

from __future__ import annotations

import re

import torch

from trainer.hf.config_values import CONFIG_KEYS, check_config_values, rope_fields, rope_kind
from trainer.hf.folder import DTYPE_NAMES, ExportError, Spec, rename
from trainer.model_values import values_problem
from trainer.models.llama import FLAVORS, ModelArgs, RopeScaling

MODEL_TYPE = "llama"
QWEN3 = "qwen3"
MODEL_TYPES = (MODEL_TYPE, QWEN3)  # the config.json layouts this family reads (trainer.hf picks the family by them)
KIND = "dense (Llama)"
# tie_word_embeddings when config.json does not say: the config classes' defaults (LlamaConfig, Qwen3Config).
TIED_BY_DEFAULT = {MODEL_TYPE: False, QWEN3: False}

# max_position_embeddings of every RoPE-scaled reference config (Llama 3.1 with factor 8, 3.2 with factor 32).
LLAMA3_SCALED_CONTEXT = 131072

# (our fqn pattern, HF name pattern); {i} is the layer index.
_NAME_MAP = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output_head.proj.weight", "lm_head.weight"),
]


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_compile(ours), hf) for ours, hf in _NAME_MAP]
_FROM_HF = [(_compile(hf), ours) for ours, hf in _NAME_MAP]


def _rename(name: str, table: list[tuple[re.Pattern, str]], what: str) -> str:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    raise ExportError(f"{name!r} is not a {what} Llama weight name")


def to_hf_name(fqn: str) -> str:
    """`layers.0.attention.q_proj.weight` -> `model.layers.0.self_attn.q_proj.weight`."""
    return _rename(fqn, _TO_HF, "known (trainer)")


def from_hf_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `layers.0.attention.q_proj.weight`."""
    return _rename(name, _FROM_HF, "known Hugging Face")


def model_type(args: ModelArgs) -> str:
    """Qwen3's layout for a model with per-head q/k norms (Llama has none), Llama's otherwise."""
    return QWEN3 if args.qk_norm else MODEL_TYPE


def architecture(args: ModelArgs) -> str:
    return {MODEL_TYPE: "LlamaForCausalLM", QWEN3: "Qwen3ForCausalLM"}[model_type(args)]


def check_exportable(args: ModelArgs) -> list[str]:
    """Every dense model has its exact target; nothing to warn about."""
    return []


def spec(fqn: str, args: ModelArgs) -> Spec:
    return rename(to_hf_name(fqn))


def attention_shapes(args: ModelArgs, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's norms and attention, by our fqn (every family's blocks have them)."""
    kv = args.n_kv_heads * args.head_dim
    return {
        f"layers.{i}.attention_norm.weight": (args.dim,),
        f"layers.{i}.attention.q_proj.weight": (args.n_heads * args.head_dim, args.dim),
        f"layers.{i}.attention.k_proj.weight": (kv, args.dim),
        f"layers.{i}.attention.v_proj.weight": (kv, args.dim),
        f"layers.{i}.attention.o_proj.weight": (args.dim, args.n_heads * args.head_dim),
        **({f"layers.{i}.attention.q_norm.weight": (args.head_dim,),
            f"layers.{i}.attention.k_norm.weight": (args.head_dim,)} if args.qk_norm else {}),
        f"layers.{i}.mlp_norm.weight": (args.dim,),
    }


def mlp_shapes(prefix: str, *, dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's weights under `prefix` (a dense block's `layers.{i}.mlp`, a shared expert)."""
    return {
        f"{prefix}.gate_proj.weight": (hidden, dim),
        f"{prefix}.up_proj.weight": (hidden, dim),
        f"{prefix}.down_proj.weight": (dim, hidden),
    }


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama with these args, by our fqn, in module order (a tied head too: our state dict
    names the one table twice; an export writes it once)."""
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update(attention_shapes(args, i))
        shapes.update(mlp_shapes(f"layers.{i}.mlp", dim=args.dim, hidden=args.ffn_dim))
    shapes["norm.weight"] = (args.dim,)
    shapes["output_head.proj.weight"] = (args.vocab_size, args.dim)
    return shapes


def rope_config(args: ModelArgs) -> dict:
    """The RoPE fields of config.json, in the keys transformers 4.x reads (5.x converts them)."""
    s = args.rope_scaling
    rope_scaling = None if s is None else {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_seq_len,
    }
    return {
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        # What the reference configs write: the scaled context, not original_max_position_embeddings
        # (transformers warns when the two are equal).
        "max_position_embeddings": args.max_seq_len if s is None else max(args.max_seq_len, LLAMA3_SCALED_CONTEXT),
    }


def common_config(args: ModelArgs, *, dtype: torch.dtype) -> dict:
    """The config.json fields every family writes (decoder shapes, norm, RoPE, untied head, dtype)."""
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        **rope_config(args),
        "tie_word_embeddings": args.tie_word_embeddings,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict:
    """config.json for `LlamaForCausalLM` or `Qwen3ForCausalLM` (keys read by transformers 4.x and 5.x)."""
    config = {"architectures": [architecture(args)], "model_type": model_type(args),
              **common_config(args, dtype=dtype), "attention_bias": False}
    if args.qk_norm:
        return config | {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}
    return config | {"mlp_bias": False}


def check_rope(config: dict, args: ModelArgs, *, where: str) -> None:
    rope, theta = rope_fields(config, where=where)
    if theta is not None and float(theta) != args.rope_theta:
        raise ExportError(f"{where}: rope_theta={theta} but the trainer model has {args.rope_theta}")
    kind = rope_kind(rope)
    if kind not in ("default", "llama3"):
        raise ExportError(f"{where}: rope_type={kind!r} has no equivalent in this trainer (plain RoPE, or Llama 3's "
                          "'llama3' scaling)")
    has_scaling = kind == "llama3"
    if has_scaling != (args.rope_scaling is not None) or (
        has_scaling and float(rope.get("factor", 0)) != args.rope_scaling.factor
    ):
        raise ExportError(f"{where}: rope scaling {rope or None} does not match the trainer model's "
                          f"{args.rope_scaling}")


def check_hf_config(config: dict, args: ModelArgs, *, where: str) -> None:
    """Raise ExportError naming the first field where an HF config.json disagrees with args, or that neither our
    model nor this mapping has."""
    expected = {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.ffn_dim,
    }
    for key, value in expected.items():
        if config.get(key) != value:
            raise ExportError(f"{where}: {key}={config.get(key)} but the trainer model has {value} "
                              f"({describe(args)})")
    if config.get("model_type", MODEL_TYPE) != model_type(args):
        why = "per-head q/k norms (qk_norm)" if args.qk_norm else "no q/k norms"
        raise ExportError(f"{where}: model_type={config.get('model_type')!r}, but the trainer model has {why}: "
                          f"expected {model_type(args)!r}")
    if config.get("head_dim", args.head_dim) != args.head_dim:
        raise ExportError(f"{where}: head_dim={config['head_dim']} but the trainer model has {args.head_dim}")
    tied = bool(config.get("tie_word_embeddings", tied_by_default(config)))
    if tied != args.tie_word_embeddings:
        raise ExportError(f"{where}: tie_word_embeddings={str(tied).lower()} but the trainer model has "
                          f"{str(args.tie_word_embeddings).lower()}")
    check_unsupported(config, where=where)
    check_rope(config, args, where=where)


def check_unsupported(config: dict, *, where: str) -> None:
    """A one-line ExportError for the first setting of a Llama or Qwen3 config.json that our dense model lacks."""
    refused = [
        ("hidden_act", config.get("hidden_act", "silu") != "silu", "this trainer's MLP is SwiGLU with silu"),
        ("attention_bias", bool(config.get("attention_bias")), "this trainer's attention has no biases"),
        ("mlp_bias", bool(config.get("mlp_bias")), "this trainer's MLP has no biases"),
        ("use_sliding_window", bool(config.get("use_sliding_window")), "this trainer's attention is full causal"),
        ("layer_types", any(t != "full_attention" for t in config.get("layer_types") or []),
         "this trainer's attention is full causal in every layer"),
    ]
    for key, bad, why in refused:
        if bad:
            raise ExportError(f"{where}: {key}={config.get(key)!r} has no equivalent: {why}")


def decoder_fields(config: dict, flavors: list[ModelArgs]) -> dict:
    """ModelArgs fields of a config.json's decoder: shapes, norm, RoPE, context; KeyError/ValueError if absent.

    The FFN width comes from (multiple_of, ffn_dim_multiplier): a flavor's when it gives this
    width, else the pair that gives exactly `intermediate_size`.
    """
    dim, ffn = int(config["hidden_size"]), int(config["intermediate_size"])
    n_heads = int(config["num_attention_heads"])
    rope, theta = rope_fields(config)
    scaling = None
    if rope_kind(rope) == "llama3":
        scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_seq_len=int(rope["original_max_position_embeddings"]))
    hidden = int(2 * 4 * dim / 3)
    multiple_of, multiplier = ffn, (None if ffn >= hidden else ffn / hidden)
    for flavor in flavors:
        if flavor.dim == dim and flavor.ffn_dim == ffn:
            multiple_of, multiplier = flavor.multiple_of, flavor.ffn_dim_multiplier
            break
    return dict(
        dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads), vocab_size=int(config["vocab_size"]),
        multiple_of=multiple_of, ffn_dim_multiplier=multiplier, norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 8192)),
    )


def check_head_dim(config: dict, args: ModelArgs, *, where: str) -> None:
    """For a layout whose mapping assumes head_dim = hidden_size / num_attention_heads (the MoE ones)."""
    if config.get("head_dim", args.head_dim) != args.head_dim:
        raise ExportError(f"{where}: head_dim={config['head_dim']} but hidden_size/num_attention_heads is "
                          f"{args.head_dim}; this trainer's MoE layouts have no separate head_dim")


def args_from_hf_config(config: dict, *, where: str) -> ModelArgs:
    """ModelArgs of a Hugging Face Llama or Qwen3 config.json of any shape (checked back against it with
    `check_hf_config`): a head_dim apart from hidden_size / num_attention_heads, any intermediate_size, a tied
    head, Qwen3's q/k norms."""
    kind = config.get("model_type", MODEL_TYPE)
    head_dim_key = {"explicit_head_dim": "head_dim"} if config.get("head_dim") is not None else {}
    check_config_values(config, {**CONFIG_KEYS, **head_dim_key}, where=where)
    check_unsupported(config, where=where)
    try:
        fields = decoder_fields(config, list(FLAVORS.values()))
        ffn, dim = int(config["intermediate_size"]), fields["dim"]
        if not any(f.dim == dim and f.ffn_dim == ffn for f in FLAVORS.values()):  # the width itself, no rule
            fields.update(multiple_of=256, ffn_dim_multiplier=None, explicit_ffn_dim=ffn)
        head_dim = int(config.get("head_dim") or dim // fields["n_heads"])
        args = ModelArgs(**fields, explicit_head_dim=0 if head_dim * fields["n_heads"] == dim else head_dim,
                         tie_word_embeddings=bool(config.get("tie_word_embeddings", tied_by_default(config))),
                         qk_norm=kind == QWEN3)
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: not a {kind} config ({type(e).__name__}: {e})") from None
    if problem := values_problem({f: getattr(args, f) for f in ("dim", "n_heads", "n_kv_heads", "explicit_head_dim")},
                                 keys={"dim": "hidden_size", "n_heads": "num_attention_heads",
                                       "n_kv_heads": "num_key_value_heads", "explicit_head_dim": "head_dim"}):
        raise ExportError(f"{where}: {problem} (not a model this trainer can load)")
    check_hf_config(config, args, where=where)
    return args


def describe(args: ModelArgs) -> str:
    shape = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim")
    return ", ".join(f"{k}={getattr(args, k)}" for k in shape)


def tied_by_default(config: dict) -> bool:
    """tie_word_embeddings when config.json does not say (transformers' LlamaConfig and Qwen3Config defaults)."""
    return TIED_BY_DEFAULT.get(config.get("model_type", MODEL_TYPE), False)
