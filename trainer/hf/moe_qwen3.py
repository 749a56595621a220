"""The MoE family's third Hugging Face layout: `Qwen3MoeForCausalLM` (model_type "qwen3_moe"), for an MoE model with
per-head q/k norms (`qk_norm`). trainer/hf/moe.py picks it and shares the rest (names, experts per expert).

Checked line by line against transformers' modeling_qwen3_moe.py, and by logits both ways (tests/unit/test_hf_moe.py):

| ours (MoEArgs) | Qwen3MoeConfig / Qwen3MoeForCausalLM |
| --- | --- |
| `score_func = "softmax"`, scores in fp32, top-k | `Qwen3MoeTopKRouter`: softmax in fp32, top-k (`mlp.gate.weight`, no bias) |
| `route_norm` | `norm_topk_prob` (/ sum, no epsilon) |
| `n_experts`, `top_k`, `moe_ffn_dim` | `num_experts`, `num_experts_per_tok`, `moe_intermediate_size` |
| `dense_ffn_dim` (the dense blocks' width: `ffn_dim`) | `intermediate_size` (`Qwen3MoeMLP` of the dense blocks) |
| `is_moe_layer(i)`: i >= n_dense_layers, (i + 1) % sparse_step = 0, i not in dense_layers | `Qwen3MoeDecoderLayer`: i not in `mlp_only_layers`, (i + 1) % `decoder_sparse_step` = 0 |
| `qk_norm` (always), `head_dim`, `tie_word_embeddings` | `q_norm` / `k_norm` on the head dim, `head_dim`, `tie_word_embeddings` |
| `aux_loss_coef` (sequence-wise, trainer/models/moe.py) | `router_aux_loss_coef` (transformers' batch-wise loss; training only) |
| no shared experts, no expert bias (`bias_update_rate = 0`) | none in the layout |

An export writes `mlp_only_layers` as the leading `n_dense_layers` and `dense_layers` together; an import reads them
back as `dense_layers` (the same blocks). The expert bias is written nowhere: an export refuses a model whose balancer
ran (`bias_update_rate` > 0) or whose biases are not zero, and an import fills them with zeros.
"""

from __future__ import annotations

import torch

from trainer.hf.config_values import CONFIG_KEYS, CONFIG_RULES, check_config_values
from trainer.hf.folder import ExportError, Spec
from trainer.hf.llama import check_rope, check_unsupported, common_config, decoder_fields
from trainer.model_values import MoEArgs, Rule

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
# transformers' Qwen3MoeConfig defaults for the keys a foreign config.json may leave out (ours writes them all).
DEFAULTS = {"num_experts_per_tok": 8, "num_experts": 128, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": False, "tie_word_embeddings": False}
# Our MoEArgs field -> its config.json key (the rules of the field check the value: trainer.model_values).
KEYS = {"n_experts": "num_experts", "top_k": "num_experts_per_tok", "moe_ffn_dim": "moe_intermediate_size",
        "sparse_step": "decoder_sparse_step", "dense_layers": "mlp_only_layers"}
_CONFIG_RULES = {**CONFIG_RULES, "norm_topk_prob": Rule("bool", optional=True),
                 "router_aux_loss_coef": Rule("float", low=0, high=1e6, optional=True)}
# What check_hf_config compares (the weights' shapes), with its config.json key.
_SHAPES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
           "ffn_dim": "intermediate_size", "n_experts": "num_experts", "moe_ffn_dim": "moe_intermediate_size",
           "tie_word_embeddings": "tie_word_embeddings"}


def _get(config: dict, key: str):
    value = config.get(key)
    return DEFAULTS.get(key) if value is None else value


def mlp_only_layers(args: MoEArgs) -> list[int]:
    """The blocks transformers must build dense whatever decoder_sparse_step says: ours, leading and listed."""
    return sorted(set(range(min(args.n_dense_layers, args.n_layers))) | set(args.dense_layers))


def check_exportable(args: MoEArgs) -> None:
    """A one-line ExportError for what Qwen3MoeForCausalLM has no place for."""
    refused = [
        ("moe.score_func", args.score_func != "softmax", repr(args.score_func), "its router scores by softmax",
         "moe.score_func='softmax'"),
        ("moe.n_shared_experts", args.n_shared_experts > 0, args.n_shared_experts, "it has no shared experts",
         "moe.n_shared_experts=0"),
        ("moe.bias_update_rate", args.bias_update_rate > 0, args.bias_update_rate,
         "it has no expert bias (aux-loss-free balancing)", "moe.bias_update_rate=0"),
    ]
    for key, bad, value, why, fix in refused:
        if bad:
            raise ExportError(f"{key}={value} has no mapping in {ARCHITECTURE} (the MoE export of a model with "
                              f"model.qk_norm=true): {why}; train with {fix} to export")


def expert_bias_spec(args: MoEArgs) -> Spec:
    """The expert bias, which the layout has not: written as nothing (refused unless zero), read as zeros."""
    def split(t: torch.Tensor) -> list[torch.Tensor]:
        if t.device.type != "meta" and bool(t.any()):
            raise ExportError(f"an expert bias is not zero (max |bias| {t.abs().max().item():.3g}): {ARCHITECTURE} "
                              "has none, so its routing would differ; this model trained with aux-loss-free "
                              "balancing cannot be exported to it")
        return []

    return Spec((), split, lambda ts: torch.zeros(args.n_experts), keep_fp32=True)


def hf_config(args: MoEArgs, *, dtype: torch.dtype) -> dict:
    """config.json of Qwen3MoeForCausalLM (keys read by transformers 4.x and 5.x)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **common_config(args, dtype=dtype),
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "norm_topk_prob": args.route_norm,
        "decoder_sparse_step": args.sparse_step,
        "mlp_only_layers": mlp_only_layers(args),
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def args_from_hf_config(config: dict, *, where: str) -> MoEArgs:
    """MoEArgs of a Qwen3MoeForCausalLM config.json of any shape; ExportError for what ours has no equivalent of."""
    config = _one_expert_count(config, where=where)
    head_dim_key = {"explicit_head_dim": "head_dim"} if config.get("head_dim") is not None else {}
    check_config_values({**config, **{key: _get(config, key) for key in KEYS.values()}},
                        {**CONFIG_KEYS, **head_dim_key, **KEYS}, where=where, rules=_CONFIG_RULES)
    check_unsupported(config, where=where)
    try:
        fields = decoder_fields(config, [])
        n_heads = fields["n_heads"]
        head_dim = int(config.get("head_dim") or fields["dim"] // n_heads)
        args = MoEArgs(
            **{**fields, "multiple_of": 256, "ffn_dim_multiplier": None},  # the width is intermediate_size itself
            explicit_head_dim=0 if head_dim * n_heads == fields["dim"] else head_dim,
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings")), qk_norm=True,
            dense_ffn_dim=int(config["intermediate_size"]), n_shared_experts=0, n_dense_layers=0,
            **{ours: _get(config, key) for ours, key in KEYS.items()},
            score_func="softmax", route_norm=bool(_get(config, "norm_topk_prob")),
            aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0), bias_update_rate=0.0,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: not a {MODEL_TYPE} config ({type(e).__name__}: {e})") from None
    check_rope(config, args, where=where)  # a RoPE ours has not (Qwen3's long-context "yarn") is refused, not dropped
    return args


def _one_expert_count(config: dict, *, where: str) -> dict:
    """config.json with its expert count as `num_experts`: the published configs' key, which transformers 5 writes as
    `num_local_experts` (Qwen3MoeConfig.attribute_map)."""
    if config.get("num_local_experts") is None:
        return config
    if config.get("num_experts") not in (None, config["num_local_experts"]):
        raise ExportError(f"{where}: num_experts={config['num_experts']!r} but num_local_experts="
                          f"{config['num_local_experts']!r} (two names of one count): make them agree, or remove one")
    return {**config, "num_experts": config["num_local_experts"]}


def check_hf_config(config: dict, args: MoEArgs, *, where: str) -> None:
    """Raise ExportError naming the first config.json field whose weights differ from args'; routing that keeps the
    weights' meaning (top_k, norm_topk_prob) is not compared: a run sets its own."""
    theirs = args_from_hf_config(config, where=where)
    for field, key in _SHAPES.items():
        if getattr(theirs, field) != getattr(args, field):
            raise ExportError(f"{where}: {key}={getattr(theirs, field)} but the trainer model has "
                              f"{getattr(args, field)}")
    # Which blocks route: compared after the shapes, whose n_layers bounds the loop (the files bound n_layers).
    if (ours := _moe_blocks(args)) != (those := _moe_blocks(theirs)):
        raise ExportError(f"{where}: decoder_sparse_step={theirs.sparse_step} and mlp_only_layers="
                          f"{list(theirs.dense_layers)} make blocks {those} MoE, but the trainer model's MoE blocks "
                          f"are {ours}")
    check_rope(config, args, where=where)


def _moe_blocks(args: MoEArgs) -> list[int]:
    return [i for i in range(args.n_layers) if args.is_moe_layer(i)]

