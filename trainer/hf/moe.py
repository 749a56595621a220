"""The MoE family in Hugging Face layouts: `Ernie4_5_MoeForCausalLM` (softmax scores), `Glm4MoeForCausalLM` (sigmoid),
and for a model with q/k norms `Qwen3MoeForCausalLM` (its config.json and what differs: trainer/hf/moe_qwen3.py).

Checked line by line against transformers' modeling code, and by logits (tests/unit/test_hf_moe.py):

| ours (trainer/models/moe.py) | Ernie4_5_Moe (score_func='softmax') | Glm4Moe (score_func='sigmoid') |
| --- | --- | --- |
| scores = softmax / sigmoid of `router.gate` (fp32) | softmax, fp32 | sigmoid, fp32 |
| top-k of scores + `router.expert_bias` | `mlp.moe_statics.e_score_correction_bias` [1, E] | `mlp.gate.e_score_correction_bias` [E] (n_group = topk_group = 1) |
| weights = the chosen scores | / clamp(sum, moe_norm_min = 1.0): a softmax top-k sums to <= 1, so / 1 | norm_topk_prob = false, routed_scaling_factor = 1 |
| ... / their sum when `route_norm` | moe_norm_min = 0.0: / sum | norm_topk_prob = true: / (sum + 1e-20), the same in fp32 unless the sum is < 1e-13 |
| shared experts: one MLP of n_shared_experts x moe_ffn_dim | `mlp.shared_experts` | `mlp.shared_experts`; none = a zero-width one (outputs 0) |
| first n_dense_layers blocks dense | moe_layer_start_index | first_k_dense_replace |
| RoPE "rotate half" | interleaved pairs: q/k rows permuted per head | rotate half, partial_rotary_factor = 1 |

Experts are written per expert (`mlp.experts.{j}.{gate,up,down}_proj.weight`), the layout of
the published checkpoints that transformers 4.x loads as is and 5.x fuses on load. The expert
bias is written in fp32 whatever the export dtype (its rounding would change routing).
Token dropping (`capacity_factor` > 0) has no counterpart there: the export routes every token.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import torch

from trainer.hf import moe_qwen3 as qwen3
from trainer.hf.config_values import CONFIG_KEYS, CONFIG_RULES, check_config_values, rope_fields
from trainer.hf.folder import ExportError, Spec, rename
from trainer.hf.llama import (
    attention_shapes, check_head_dim, check_rope, common_config, decoder_fields, mlp_shapes, to_hf_name,
)
from trainer.model_values import Rule
from trainer.models.moe import MOE_FLAVORS, MoEArgs

ERNIE, GLM, QWEN3 = "ernie4_5_moe", "glm4_moe", qwen3.MODEL_TYPE
_BY_SCORES = {"softmax": ERNIE, "sigmoid": GLM}
MODEL_TYPES = (*_BY_SCORES.values(), QWEN3)  # the config.json layouts this family reads (trainer.hf picks the family)
KIND = "MoE"
_ARCHITECTURES = {ERNIE: "Ernie4_5_MoeForCausalLM", GLM: "Glm4MoeForCausalLM", QWEN3: qwen3.ARCHITECTURE}
# transformers' defaults for keys a foreign config.json may leave out (ours writes them all).
_DEFAULTS = {
    ERNIE: {"moe_k": 6, "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
            "moe_layer_end_index": -1, "moe_layer_interval": 1, "moe_norm_min": 1e-12, "use_bias": False,
            "tie_word_embeddings": True},
    GLM: {"num_experts_per_tok": 8, "n_routed_experts": 128, "n_shared_experts": 1, "first_k_dense_replace": 1,
          "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
          "use_qk_norm": False, "attention_bias": False, "partial_rotary_factor": 0.5, "tie_word_embeddings": False},
    QWEN3: qwen3.DEFAULTS,
}
# Our MoEArgs field -> its config.json key, per target (for one-line mismatch messages).
_KEYS = {
    ERNIE: {"n_experts": "moe_num_experts", "top_k": "moe_k", "n_shared_experts": "moe_num_shared_experts",
            "n_dense_layers": "moe_layer_start_index"},
    GLM: {"n_experts": "n_routed_experts", "top_k": "num_experts_per_tok", "n_shared_experts": "n_shared_experts",
          "n_dense_layers": "first_k_dense_replace"},
}
_COMMON_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_dim": "intermediate_size",
                "moe_ffn_dim": "moe_intermediate_size"}
# The routing keys read besides the model arguments' (checked by type and range first: trainer/hf/config_values.py).
_FLAG, _FACTOR = Rule("bool", optional=True), Rule("float", low=0, high=1e6)
_CONFIG_RULES = {
    **CONFIG_RULES,
    "moe_layer_end_index": Rule("int", low=-1), "moe_layer_interval": Rule("int"), "moe_norm_min": _FACTOR,
    "use_bias": _FLAG, "n_group": Rule("int"), "topk_group": Rule("int"), "routed_scaling_factor": _FACTOR,
    "norm_topk_prob": _FLAG, "use_qk_norm": _FLAG, "partial_rotary_factor": Rule("float", low=0, high=1, open_low=True),
    "router_aux_loss_coef": Rule("float", low=0, high=1e6, optional=True),
}
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "n_experts", "moe_ffn_dim",
                 "n_shared_experts", "n_dense_layers")
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def model_type(args: MoEArgs) -> str:
    return QWEN3 if args.qk_norm else _BY_SCORES[args.score_func]


def architecture(args: MoEArgs) -> str:
    return _ARCHITECTURES[model_type(args)]


def check_exportable(args: MoEArgs) -> list[str]:
    """Raise a one-line ExportError for routing options without an exact target; return what to warn about."""
    if model_type(args) == QWEN3:
        qwen3.check_exportable(args)
    else:
        _check_ernie_glm_exportable(args)
    if args.score_func == "sigmoid" and args.n_experts < 2:
        raise ExportError(f"score_func='sigmoid' with n_experts={args.n_experts} has no Hugging Face target: "
                          "Glm4MoeForCausalLM's router takes the best 2 scores of its expert group")
    notes = []
    if args.capacity_factor > 0:
        notes.append(f"capacity_factor={args.capacity_factor} (token dropping) has no counterpart in "
                     f"{architecture(args)}: the export routes every token, so its logits equal this model's "
                     "with capacity_factor=0")
    return notes


def _check_ernie_glm_exportable(args: MoEArgs) -> None:
    """What Ernie4_5_Moe and Glm4Moe, the layouts of a model without q/k norms, have no place for."""
    for key, value, default in (("model.tie_word_embeddings", args.tie_word_embeddings, False),
                                ("model.head_dim", args.head_dim, args.dim // args.n_heads),
                                ("moe.sparse_step", args.sparse_step, 1),
                                ("moe.dense_layers", list(args.dense_layers), [])):
        if value != default:
            shown, fix = (str(v).lower() if isinstance(v, bool) else v for v in (value, default))
            raise ExportError(f"{key}={shown} has no mapping in this trainer's MoE export ({architecture(args)}): "
                              f"train with {key}={fix} to export (or with model.qk_norm=true, whose export is "
                              f"{qwen3.ARCHITECTURE})")


def expected_shapes(args: MoEArgs, *, attention: Callable[[MoEArgs, int], dict[str, tuple[int, ...]]]
                    = attention_shapes) -> dict[str, tuple[int, ...]]:
    """Every weight and the expert biases of an MoETransformer with these args, by our fqn; `attention`: block i's
    attention weights and norms (DeepSeek-V3's MLA has its own; its MoE blocks are these)."""
    d, e, h = args.dim, args.n_experts, args.moe_ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        shapes.update(attention(args, i))
        if not args.is_moe_layer(i):
            shapes.update(mlp_shapes(f"layers.{i}.mlp", dim=d, hidden=args.ffn_dim))
            continue
        shapes.update({
            f"layers.{i}.moe.router.gate.weight": (e, d),
            f"layers.{i}.moe.router.expert_bias": (e,),
            f"layers.{i}.moe.experts.w1": (e, h, d),
            f"layers.{i}.moe.experts.w2": (e, d, h),
            f"layers.{i}.moe.experts.w3": (e, h, d),
        })
        if args.n_shared_experts:
            shapes.update(mlp_shapes(f"layers.{i}.moe.shared_expert", dim=d, hidden=args.n_shared_experts * h))
    shapes["norm.weight"] = (d,)
    shapes["output_head.proj.weight"] = (args.vocab_size, d)
    return shapes


def _interleave_rope_rows(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Our rows of each head (first halves, then second halves) -> Ernie's: row 2j = ours j, 2j+1 = ours j + half.

    Ernie's RoPE rotates the pairs (2j, 2j+1) with frequency j, ours (j, j + half): the same
    rotation after this permutation, applied alike to q and k, so q.k is unchanged.
    """
    return t.reshape(-1, 2, head_dim // 2, t.shape[-1]).transpose(1, 2).reshape(t.shape)


def _halve_rope_rows(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `_interleave_rope_rows`."""
    return t.reshape(-1, head_dim // 2, 2, t.shape[-1]).transpose(1, 2).reshape(t.shape)


def spec(fqn: str, args: MoEArgs) -> Spec:
    """How our tensor `fqn` is stored in the target's safetensors."""
    target = model_type(args)
    m = _LAYER.match(fqn)
    if m is None or not m.group(2).startswith("moe."):
        name = to_hf_name(fqn)  # embeddings, norms, attention, dense blocks, head: Llama's names
        if target == ERNIE and re.search(r"\.self_attn\.[qk]_proj\.weight$", name):
            hd = args.head_dim
            return Spec((name,), lambda t: [_interleave_rope_rows(t, hd)], lambda ts: _halve_rope_rows(ts[0], hd))
        return rename(name)
    return routed_spec(fqn, args, target=target)


def routed_spec(fqn: str, args: MoEArgs, *, target: str, kind: str = "MoE") -> Spec:
    """How a block's routed part `fqn` (`layers.{i}.moe.*`) is stored in `target`'s layout; GLM's is DeepseekV3's
    too (transformers' Glm4MoeMoE is DeepseekV3MoE's: trainer/hf/deepseek_v3.py calls this). `kind` names the family
    in the error for an unknown name."""
    i, rest = _LAYER.match(fqn).groups()
    mlp = f"model.layers.{i}.mlp"
    if rest == "moe.router.gate.weight":
        if target == GLM and not args.n_shared_experts:
            # Glm4MoeMoE (DeepseekV3MoE) always has a shared-expert MLP: with none of ours it gets width 0 and adds
            # exactly 0.
            d = args.dim
            names = (f"{mlp}.gate.weight", *(f"{mlp}.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj",
                                                                                          "down_proj")))
            return Spec(names, lambda t: [t, t.new_zeros(0, d), t.new_zeros(0, d), t.new_zeros(d, 0)],
                        lambda ts: ts[0])
        return rename(f"{mlp}.gate.weight")
    if rest == "moe.router.expert_bias":
        if target == QWEN3:
            return qwen3.expert_bias_spec(args)
        if target == ERNIE:
            return Spec((f"{mlp}.moe_statics.e_score_correction_bias",), lambda t: [t.reshape(1, -1)],
                        lambda ts: ts[0].reshape(-1), keep_fp32=True)
        return Spec((f"{mlp}.gate.e_score_correction_bias",), lambda t: [t], lambda ts: ts[0], keep_fp32=True)
    if rest.startswith("moe.experts.") and rest[len("moe.experts."):] in _EXPERT_NAMES:
        proj = _EXPERT_NAMES[rest[len("moe.experts."):]]
        names = tuple(f"{mlp}.experts.{j}.{proj}.weight" for j in range(args.n_experts))
        return Spec(names, lambda t: list(t.unbind(0)), lambda ts: torch.stack(ts))
    if m2 := re.fullmatch(r"moe\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight", rest):
        return rename(f"{mlp}.shared_experts.{m2.group(1)}.weight")
    raise ExportError(f"{fqn!r} is not a known (trainer) {kind} weight name")


def hf_config(args: MoEArgs, *, dtype: torch.dtype) -> dict:
    """config.json of the target architecture (keys read by transformers 4.x and 5.x)."""
    target = model_type(args)
    if target == QWEN3:
        return qwen3.hf_config(args, dtype=dtype)
    config = {
        "architectures": [architecture(args)],
        "model_type": target,
        **common_config(args, dtype=dtype),
        "moe_intermediate_size": args.moe_ffn_dim,
        "router_aux_loss_coef": args.aux_loss_coef,
    }
    if target == ERNIE:
        config.update({
            "use_bias": False, "moe_num_experts": args.n_experts, "moe_k": args.top_k,
            "moe_num_shared_experts": args.n_shared_experts, "moe_layer_start_index": args.n_dense_layers,
            "moe_layer_end_index": args.n_layers - 1, "moe_layer_interval": 1,
            "moe_norm_min": 0.0 if args.route_norm else 1.0,
        })
    else:
        config.update({
            "n_routed_experts": args.n_experts, "num_experts_per_tok": args.top_k,
            "n_shared_experts": args.n_shared_experts, "first_k_dense_replace": args.n_dense_layers,
            "n_group": 1, "topk_group": 1, "norm_topk_prob": args.route_norm, "routed_scaling_factor": 1.0,
            "use_qk_norm": False, "attention_bias": False, "partial_rotary_factor": 1.0,
            "num_nextn_predict_layers": 0,
        })
    return config


def tied_by_default(config: dict) -> bool:
    return bool(_DEFAULTS[config.get("model_type")]["tie_word_embeddings"])


def _get(config: dict, key: str):
    return config.get(key, _DEFAULTS[config["model_type"]].get(key))


def _route_norm(config: dict, *, where: str) -> bool:
    """route_norm of a target's routing settings; ExportError where they scale in a way ours cannot."""
    if config["model_type"] == GLM:
        for key, ok in (("n_group", _get(config, "n_group") == _get(config, "topk_group")),
                        ("routed_scaling_factor", float(_get(config, "routed_scaling_factor")) == 1.0),
                        ("use_qk_norm", not _get(config, "use_qk_norm")),
                        ("attention_bias", not _get(config, "attention_bias"))):
            if not ok:
                raise ExportError(f"{where}: {key}={_get(config, key)} has no equivalent in this trainer's MoE "
                                  "(it needs n_group=topk_group, routed_scaling_factor=1, no qk norm or attention bias)")
        rope, _ = rope_fields(config, where=where)
        partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        if float(partial) != 1.0:
            raise ExportError(f"{where}: partial_rotary_factor={partial}: this trainer rotates the whole head "
                              "(partial_rotary_factor=1)")
        return bool(_get(config, "norm_topk_prob"))
    norm_min = float(_get(config, "moe_norm_min"))
    if _get(config, "use_bias") or _get(config, "moe_layer_interval") != 1 or _get(
            config, "moe_layer_end_index") not in (-1, int(config["num_hidden_layers"]) - 1):
        raise ExportError(f"{where}: only use_bias=false, moe_layer_interval=1 and MoE blocks up to the last "
                          "(moe_layer_end_index) have an equivalent in this trainer's MoE")
    if norm_min == 1.0:
        return False  # / clamp(sum, 1): a softmax top-k sums to at most 1, so the weights stay the scores
    if norm_min <= 1e-12:
        return True  # / sum, the clamp reached only by a top-k whose scores sum below 1e-12
    raise ExportError(f"{where}: moe_norm_min={norm_min} has no equivalent in this trainer's MoE (1.0 = the "
                      "scores as they are, <= 1e-12 = renormalized to sum 1)")


def args_from_hf_config(config: dict, *, where: str) -> MoEArgs:
    """MoEArgs of an Ernie4_5_Moe, Glm4Moe or Qwen3Moe config.json; ExportError for settings ours has no equivalent
    of."""
    target = config.get("model_type")
    if target not in _ARCHITECTURES:
        raise ExportError(f"{where}: model_type={target!r} is not an MoE layout this trainer reads "
                          f"({', '.join(map(repr, _ARCHITECTURES))})")
    if target == QWEN3:
        return qwen3.args_from_hf_config(config, where=where)
    keys = {**CONFIG_KEYS, "moe_ffn_dim": "moe_intermediate_size", **_KEYS[target]}
    check_config_values({**config, **{key: _get(config, key) for key in _KEYS[target].values()}}, keys, where=where,
                        rules=_CONFIG_RULES)
    try:
        fields = decoder_fields(config, [])
        ffn = int(config["intermediate_size"])
        fields["dense_ffn_dim"] = ffn
        for flavor in MOE_FLAVORS.values():  # a flavor's own FFN fields where they give this width
            if flavor.dim == fields["dim"] and flavor.ffn_dim == ffn:
                fields.update(multiple_of=flavor.multiple_of, ffn_dim_multiplier=flavor.ffn_dim_multiplier,
                              dense_ffn_dim=flavor.dense_ffn_dim)
                break
        args = MoEArgs(
            **fields, moe_ffn_dim=int(config["moe_intermediate_size"]),
            **{ours: int(_get(config, key)) for ours, key in _KEYS[target].items()},
            score_func="softmax" if target == ERNIE else "sigmoid", route_norm=_route_norm(config, where=where),
            aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0), bias_update_rate=0.0,
        )
    except ExportError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: not an {target} config ({type(e).__name__}: {e})") from None
    if config.get("hidden_act", "silu") != "silu":
        raise ExportError(f"{where}: hidden_act={config['hidden_act']!r}; this trainer's MoE uses 'silu'")
    check_head_dim(config, args, where=where)
    check_rope(config, args, where=where)  # a RoPE ours has not (a long-context "yarn") is refused, not read as plain
    return args


def check_hf_config(config: dict, args: MoEArgs, *, where: str) -> None:
    """Raise ExportError naming the first config.json field whose weights or scores differ from args'.

    Routing that keeps the weights' meaning (top_k, route_norm) is not compared: a run sets its own.
    """
    expected = model_type(args)
    if config.get("model_type") != expected:
        has = "has per-head q/k norms" if args.qk_norm else f"scores experts with {args.score_func}"
        raise ExportError(f"{where}: model_type={config.get('model_type')!r}, but the trainer model {has}, whose "
                          f"layout is {expected!r}")
    if expected == QWEN3:
        return qwen3.check_hf_config(config, args, where=where)
    if args.sparse_step != 1 or args.dense_layers:
        raise ExportError(f"{where}: the trainer model has moe.sparse_step={args.sparse_step} and moe.dense_layers="
                          f"{list(args.dense_layers)}, which {expected} has no place for (its MoE blocks are all "
                          "those after the first dense ones)")
    theirs = args_from_hf_config(config, where=where)
    keys = {**_COMMON_KEYS, **_KEYS[expected]}
    for field in _SHAPE_FIELDS:
        if getattr(theirs, field) != getattr(args, field):
            raise ExportError(f"{where}: {keys[field]}={getattr(theirs, field)} but the trainer model has "
                              f"{getattr(args, field)} ({', '.join(f'{k}={getattr(args, k)}' for k in _SHAPE_FIELDS)})")
    check_rope(config, args, where=where)


def with_routing_of(args: MoEArgs, config: dict, *, where: str) -> MoEArgs:
    """`args` with the top_k and route_norm of a config.json (the weights' shapes already checked equal)."""
    theirs = args_from_hf_config(config, where=where)
    return replace(args, top_k=theirs.top_k, route_norm=theirs.route_norm)
