"""GPT-OSS in Hugging Face's layout: `GptOssForCausalLM` (model_type "gpt_oss"), of any shape, bf16 or fp32 weights.

Checked against transformers' modeling_gpt_oss.py, and by logits both ways (tests/unit/test_hf_gpt_oss.py):

| ours (trainer/models/gpt_oss.py) | GptOssForCausalLM |
| --- | --- |
| `attention.{q,k,v,o}_proj.{weight,bias}`, `attention.sinks` | `self_attn.{q,k,v,o}_proj.{weight,bias}`, `self_attn.sinks` |
| sliding window on layer i unless (i + 1) % full_attention_interval == 0 | `layer_types`, `sliding_window` |
| `moe.router.gate.{weight,bias}`; softmax, top_k, renormalized | `mlp.router.{weight,bias}`; top_k logits, softmax |
| `moe.router.expert_bias` (balancing; must be 0 to export) | none |
| `moe.experts.w13` [E, 2h, d]: gate rows, then up rows | `mlp.experts.gate_up_proj` [E, d, 2h]: gate, up interleaved |
| `moe.experts.b13` [E, 2h], `w2` [E, d, h], `b2` [E, d] | `gate_up_proj_bias` (interleaved), `down_proj` [E, h, d], `down_proj_bias` |
| YaRN RoPE (`rope_yarn`) | rope_type "yarn": factor, beta_fast, beta_slow, original_max_position_embeddings, truncate, mscale, mscale_all_dim (cos/sin only: GPT-OSS's softmax scale has no mscale) |

Released gpt-oss checkpoints store their experts in MXFP4 (`quantization_config.quant_method` "mxfp4":
`mlp.experts.{gate_up,down}_proj_{blocks,scales}`): read as those two tensors, dequantized to bfloat16 exactly as
transformers does without its kernels (trainer/hf/mxfp4.py). An export is unquantized, in its own dtype.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from trainer.hf.config_values import CONFIG_KEYS, check_config_values, rope_fields, rope_kind, yarn_config, yarn_of
from trainer.hf.folder import DTYPE_NAMES, ExportError, Spec, rename
from trainer.hf.llama import to_hf_name
from trainer.model_values import GptOssArgs, Rule, YarnScaling

MODEL_TYPES = ("gpt_oss",)
KIND = "GPT-OSS"
ARCHITECTURE = "GptOssForCausalLM"
# GptOssConfig's defaults for keys a foreign config.json may leave out (ours writes them all).
_DEFAULTS = {"head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
             "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
             "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
             "router_aux_loss_coef": 0.001}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# Our field -> its config.json key (the values' rules and the one-line messages name them).
_KEYS = {**{k: v for k, v in CONFIG_KEYS.items() if k != "ffn_dim"}, "moe_ffn_dim": "intermediate_size",
         "n_experts": "num_local_experts", "top_k": "num_experts_per_tok", "explicit_head_dim": "head_dim",
         "sliding_window": "sliding_window", "swiglu_alpha": "swiglu_alpha", "swiglu_limit": "swiglu_limit"}
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "n_experts", "moe_ffn_dim",
                 "tie_word_embeddings", "sliding_window", "full_attention_interval", "swiglu_alpha", "swiglu_limit",
                 "rope_theta", "rope_yarn")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
FULL, SLIDING = "full_attention", "sliding_attention"


# The quantized folders this family reads (trainer.hf.packed_method): the experts' weights in MXFP4.
QUANT_METHODS = ("mxfp4",)


def packed_params(args: GptOssArgs) -> int:
    """The parameters an MXFP4 folder stores packed: every MoE block's experts' gate_up_proj and down_proj."""
    return args.n_moe_layers * args.n_experts * 3 * args.dim * args.moe_ffn_dim


def architecture(args: GptOssArgs) -> str:
    return ARCHITECTURE


def tied_by_default(config: dict) -> bool:
    return False


def check_exportable(args: GptOssArgs) -> list[str]:
    """A one-line ExportError for routing GptOssForCausalLM has not (the balancing bias is checked on the weights:
    `spec`); what to warn of."""
    n_dense = args.n_layers - args.n_moe_layers  # MoEArgs.is_moe_layer: n_dense_layers, sparse_step, dense_layers
    if (args.score_func, args.route_norm, args.n_shared_experts, n_dense) != ("softmax", True, 0, 0):
        raise ExportError(f"score_func={args.score_func!r}, route_norm={args.route_norm}, n_shared_experts="
                          f"{args.n_shared_experts}, {n_dense} dense blocks: {ARCHITECTURE} routes by "
                          "softmax over the top-k logits to routed experts only in every block; set "
                          "moe.score_func='softmax', moe.route_norm=true and no shared experts or dense layers to "
                          "export")
    if args.capacity_factor > 0:
        return [f"capacity_factor={args.capacity_factor} (token dropping) has no counterpart in {ARCHITECTURE}: the "
                "export routes every token, so its logits equal this model's with capacity_factor=0"]
    return []


def expected_shapes(args: GptOssArgs) -> dict[str, tuple[int, ...]]:
    """Every weight (and the expert-bias buffer) of a GptOssTransformer with these args, by our fqn, in its order."""
    d, e, h, hd = args.dim, args.n_experts, args.moe_ffn_dim, args.head_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        a, m = f"layers.{i}.attention", f"layers.{i}.moe"
        shapes.update({
            f"layers.{i}.attention_norm.weight": (d,), f"{a}.sinks": (args.n_heads,),
            f"{a}.q_proj.weight": (q, d), f"{a}.q_proj.bias": (q,), f"{a}.k_proj.weight": (kv, d),
            f"{a}.k_proj.bias": (kv,), f"{a}.v_proj.weight": (kv, d), f"{a}.v_proj.bias": (kv,),
            f"{a}.o_proj.weight": (d, q), f"{a}.o_proj.bias": (d,), f"layers.{i}.mlp_norm.weight": (d,),
            f"{m}.router.expert_bias": (e,), f"{m}.router.gate.weight": (e, d), f"{m}.router.gate.bias": (e,),
            f"{m}.experts.w13": (e, 2 * h, d), f"{m}.experts.w2": (e, d, h), f"{m}.experts.b13": (e, 2 * h),
            f"{m}.experts.b2": (e, d),
        })
    shapes["norm.weight"] = (d,)
    shapes["output_head.proj.weight"] = (args.vocab_size, d)
    return shapes


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2h, ...] gate rows then up rows -> [E, 2h, ...] with gate j at 2j and up j at 2j + 1."""
    e, two_h = t.shape[:2]
    return t.reshape(e, 2, two_h // 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    e, two_h = t.shape[:2]
    return t.reshape(e, two_h // 2, 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def _no_balancing_bias(fqn: str, n_experts: int) -> Spec:
    """Our balancing bias has no GPT-OSS tensor: exported only where it is 0 (it then changes no choice), 0 on import."""
    def split(t: torch.Tensor) -> list[torch.Tensor]:
        if t.device.type != "meta" and bool(t.abs().max() > 0):
            raise ExportError(f"{fqn} is not zero (moe.bias_update_rate moved it): {ARCHITECTURE} has no balancing "
                              "bias, so its experts would be chosen otherwise; train with moe.bias_update_rate=0 "
                              "to export")
        return []

    return Spec((), split, lambda ts: torch.zeros(n_experts), keep_fp32=True)


def spec(fqn: str, args: GptOssArgs) -> Spec:
    """How our tensor `fqn` is stored in GptOssForCausalLM's safetensors."""
    m = _LAYER.match(fqn)
    rest = m.group(2) if m else ""
    if m is None or rest in ("attention_norm.weight", "mlp_norm.weight") or rest.endswith("_proj.weight"):
        return rename(to_hf_name(fqn))  # embeddings, norms, q/k/v/o weights, head: Llama's names
    layer = f"model.layers.{m.group(1)}"
    if rest == "moe.router.expert_bias":
        return _no_balancing_bias(fqn, args.n_experts)
    names = {"attention.sinks": "self_attn.sinks", "moe.router.gate.weight": "mlp.router.weight",
             "moe.router.gate.bias": "mlp.router.bias", "moe.experts.b2": "mlp.experts.down_proj_bias"}
    if rest in names:
        return rename(f"{layer}.{names[rest]}")
    if bias := re.fullmatch(r"attention\.([qkvo])_proj\.bias", rest):
        return rename(f"{layer}.self_attn.{bias.group(1)}_proj.bias")
    experts = f"{layer}.mlp.experts"
    if rest == "moe.experts.w13":  # ours [E, 2h, d] -> theirs [E, d, 2h], interleaved
        return Spec((f"{experts}.gate_up_proj",), lambda t: [_interleave(t).transpose(1, 2)],
                    lambda ts: _deinterleave(ts[0].transpose(1, 2)))
    if rest == "moe.experts.b13":
        return Spec((f"{experts}.gate_up_proj_bias",), lambda t: [_interleave(t)], lambda ts: _deinterleave(ts[0]))
    if rest == "moe.experts.w2":  # ours [E, d, h] -> theirs [E, h, d]
        return Spec((f"{experts}.down_proj",), lambda t: [t.transpose(1, 2)], lambda ts: ts[0].transpose(1, 2))
    raise ExportError(f"{fqn!r} is not a known (trainer) GPT-OSS weight name")


def layer_types(args: GptOssArgs) -> list[str]:
    return [SLIDING if args.is_sliding(i) else FULL for i in range(args.n_layers)]


def hf_config(args: GptOssArgs, *, dtype: torch.dtype) -> dict:
    """config.json of GptOssForCausalLM (the keys transformers 4.55+ and 5.x read)."""
    y = args.rope_yarn
    # Plain RoPE spelled out: GptOssConfig reads a missing rope_scaling as its default YaRN.
    rope = {"rope_type": "default"} if y is None else yarn_config(y)
    context = args.max_seq_len if y is None else max(args.max_seq_len, int(y.factor * y.original_max_seq_len))
    return {
        "architectures": [ARCHITECTURE], "model_type": "gpt_oss", "hidden_size": args.dim,
        "intermediate_size": args.moe_ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k, "sliding_window": args.sliding_window or context,
        "layer_types": layer_types(args), "swiglu_alpha": args.swiglu_alpha, "swiglu_limit": args.swiglu_limit,
        "attention_bias": True, "router_aux_loss_coef": args.aux_loss_coef, "hidden_act": "silu",
        "rope_theta": args.rope_theta, "rope_scaling": rope, "max_position_embeddings": context,
        "tie_word_embeddings": args.tie_word_embeddings, "torch_dtype": DTYPE_NAMES[dtype],
    }


def _get(config: dict, key: str):
    """A key's value, or GptOssConfig's default where it is missing or null (a null sliding_window: no window)."""
    if key == "sliding_window":
        return config.get(key, _DEFAULTS[key])
    value = config.get(key)
    return _DEFAULTS.get(key) if value is None else value


def _full_attention_interval(config: dict, n_layers: int, *, where: str) -> int:
    """The interval whose pattern config.json's layer_types is (GptOssConfig's default: every second layer full)."""
    types = config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {FULL, SLIDING}:
        raise ExportError(f"{where}: layer_types must be {n_layers} of {FULL!r} and {SLIDING!r} (num_hidden_layers)")
    interval = types.index(FULL) + 1 if FULL in types else n_layers + 1
    if any(t != (FULL if (i + 1) % interval == 0 else SLIDING) for i, t in enumerate(types)):
        raise ExportError(f"{where}: layer_types has no equivalent in this trainer: its full-attention layers must be "
                          f"every {interval}th (layer i full where (i + 1) % {interval} == 0)")
    return interval


def _yarn(config: dict, *, where: str) -> YarnScaling | None:
    rope, _ = rope_fields(config, where=where)
    rope = rope or _DEFAULT_ROPE
    kind = rope_kind(rope)
    if kind == "default":
        return None
    if kind != "yarn":
        raise ExportError(f"{where}: rope_type={kind!r} has no GPT-OSS equivalent in this trainer (plain or 'yarn')")
    return yarn_of(config, rope, where=where)


def args_from_hf_config(config: dict, *, where: str) -> GptOssArgs:
    """GptOssArgs of a GptOssForCausalLM config.json of any shape; ExportError for settings ours has no equivalent of
    (a quantization_config other than "mxfp4" is refused before: trainer.hf.packed_method)."""
    # rope_theta's default is rope_fields' to find (it may be in rope_parameters).
    values = {**config, **{k: _get(config, k) for k in _KEYS.values() if k in _DEFAULTS and k != "rope_theta"}}
    check_config_values(values, _KEYS, where=where, rules={"attention_bias": Rule("bool", optional=True),
                                                           "layer_types": Rule("list", high=100_000, optional=True)})
    if not _get(config, "attention_bias"):
        raise ExportError(f"{where}: attention_bias=false has no equivalent: GPT-OSS attention has biases here")
    try:
        dim, n_heads, head_dim = int(config["hidden_size"]), int(config["num_attention_heads"]), int(values["head_dim"])
        n_layers, window = int(config["num_hidden_layers"]), int(values["sliding_window"] or 0)
        interval = _full_attention_interval(config, n_layers, where=where) if window else 1
        window = window if interval > 1 else 0  # every layer full: its window (transformers needs one) is unused
        ffn = int(config["intermediate_size"])
        args = GptOssArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            vocab_size=int(config["vocab_size"]), norm_eps=float(values["rms_norm_eps"]),
            rope_theta=float(rope_fields(config, where=where)[1] or _DEFAULTS["rope_theta"]),
            max_seq_len=int(values["max_position_embeddings"]),
            explicit_head_dim=0 if head_dim * n_heads == dim else head_dim,
            tie_word_embeddings=bool(values["tie_word_embeddings"]), n_experts=int(values["num_local_experts"]),
            top_k=int(values["num_experts_per_tok"]), moe_ffn_dim=ffn, dense_ffn_dim=ffn, route_norm=True,
            aux_loss_coef=float(values.get("router_aux_loss_coef") or 0.0), bias_update_rate=0.0,
            sliding_window=window, swiglu_alpha=float(values["swiglu_alpha"]),
            swiglu_limit=float(values["swiglu_limit"]), rope_yarn=_yarn(config, where=where),
            full_attention_interval=interval,
        )
    except ExportError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: not a gpt_oss config ({type(e).__name__}: {e})") from None
    return args


def check_hf_config(config: dict, args: GptOssArgs, *, where: str) -> None:
    """Raise ExportError naming the first config.json field whose weights or computation differ from args' (routing,
    top_k, is a run's own: not compared)."""
    theirs = args_from_hf_config(config, where=where)
    keys = {**_KEYS, "head_dim": "head_dim", "full_attention_interval": "layer_types", "rope_yarn": "rope_scaling"}
    for field in _SHAPE_FIELDS:
        if getattr(theirs, field) != getattr(args, field):
            raise ExportError(f"{where}: {keys[field]} gives {field}={getattr(theirs, field)} but the trainer model "
                              f"has {getattr(args, field)}")


def with_routing_of(args: GptOssArgs, config: dict, *, where: str) -> GptOssArgs:
    """`args` with the top_k of a config.json (the weights' shapes already checked equal)."""
    return replace(args, top_k=args_from_hf_config(config, where=where).top_k)
