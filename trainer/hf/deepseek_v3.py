"""The DeepSeek-V3 family in the Hugging Face layout `DeepseekV3ForCausalLM` (model_type "deepseek_v3").

Checked line by line against transformers' modeling_deepseek_v3.py, and by logits both ways
(tests/unit/test_hf_deepseek_v3.py):

| ours (trainer/models/deepseek_v3.py, mla.py) | DeepseekV3 config.json / weights |
| --- | --- |
| q_lora_rank (0: `attention.q_proj`) | q_lora_rank (null: `self_attn.q_proj`) |
| `attention.q_a_proj`, `q_a_layernorm`, `q_b_proj` | the same names under `self_attn` |
| `attention.kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj` | the same names under `self_attn` |
| kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim | the same keys |
| RoPE "rotate half" over (j, j + half) | rope_interleave = true: pairs (2j, 2j + 1); the RoPE rows of q_b_proj (q_proj) and kv_a_proj_with_mqa are permuted per head (DeepSeek's checkpoints' layout; rope_interleave = false is refused on import) |
| scale 1/sqrt(qk_nope + qk_rope), times mscale(mscale_all_dim)^2 with YaRN | the same (`yarn_apply_mscale`) |
| YaRN RoPE (`rope_yarn`) over qk_rope_head_dim | rope_scaling "yarn": factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate (DeepSeek-V3/R1's: 40, 4096, 32, 1, 1.0, 1.0); other RoPE scalings are refused |
| `moe.router.gate`, `moe.router.expert_bias` (fp32) | `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` |
| n_experts, top_k, n_group, topk_group, route_norm, routed_scaling_factor | n_routed_experts, num_experts_per_tok, n_group, topk_group, norm_topk_prob, routed_scaling_factor |
| `moe.experts.{w1,w2,w3}` | `mlp.experts.{j}.{gate,down,up}_proj.weight` per expert (transformers 5 fuses them on load) |
| `moe.shared_expert.*` (none with n_shared_experts = 0) | `mlp.shared_experts.*` (always there: zero-width when 0, adding exactly 0) |
| n_dense_layers, `layers.{i}.mlp.*` | first_k_dense_replace |
| mtp_layers (`layers.{n_layers + k}.*`) | num_nextn_predict_layers: not exported (transformers' model ignores `model.layers.{n}.*`, 0 is written); skipped on import with a note |

Score function: sigmoid only (transformers' DeepseekV3TopkRouter); hidden_act silu; no attention bias.

Released DeepSeek-V3/R1 folders are block FP8 (`quantization_config.quant_method` "fp8", `weight_block_size`
[128, 128]): each quantized `X.weight` float8_e4m3fn with `X.weight_scale_inv` float32 per block, dequantized to
bfloat16 on read (trainer/hf/fp8.py). An export is unquantized, in its own dtype.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import torch

from trainer.hf.config_values import (CONFIG_KEYS, CONFIG_RULES, check_config_values, rope_fields, rope_kind,
                                      yarn_config, yarn_of)
from trainer.hf import moe
from trainer.hf.folder import ExportError, Header, Spec, rename
from trainer.hf.llama import common_config, decoder_fields, to_hf_name
from trainer.model_values import DeepseekV3Args, Rule, YarnScaling
from trainer.models.counts import param_count
from trainer.models.deepseek_v3 import FLAVORS

logger = logging.getLogger("trainer.hf")

MODEL_TYPE = "deepseek_v3"
MODEL_TYPES = (MODEL_TYPE,)
KIND = "DeepSeek-V3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# transformers' DeepseekV3Config defaults for keys a foreign config.json may leave out (ours writes them all).
_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "n_routed_experts": 256,
             "n_shared_experts": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
             "rope_interleave": True, "tie_word_embeddings": False, "attention_bias": False,
             "moe_intermediate_size": 2048}
# Our field -> its config.json key (DeepseekV3Args' own and the MoE ones).
_KEYS = {"n_experts": "n_routed_experts", "top_k": "num_experts_per_tok", "n_shared_experts": "n_shared_experts",
         "n_dense_layers": "first_k_dense_replace", "moe_ffn_dim": "moe_intermediate_size",
         "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
         "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "n_group": "n_group",
         "topk_group": "topk_group", "routed_scaling_factor": "routed_scaling_factor"}
_CONFIG_RULES = {
    **CONFIG_RULES, "q_lora_rank": Rule("int", low=0, optional=True), "norm_topk_prob": Rule("bool", optional=True),
    "rope_interleave": Rule("bool", optional=True), "num_nextn_predict_layers": Rule("int", low=0, optional=True),
    "router_aux_loss_coef": Rule("float", low=0, high=1e6, optional=True),
}
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim", "n_experts", "moe_ffn_dim", "n_shared_experts",
                 "n_dense_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")
_MLA_NAMES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "o_proj")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.")


# The quantized folders this family reads (trainer.hf.packed_method): block FP8, as DeepSeek-V3/R1 are released.
QUANT_METHODS = ("fp8",)


def packed_params(args: DeepseekV3Args) -> int:
    """The parameters an FP8 folder may store in float8 (the size bound's): every matrix but the routers' gates.
    DeepSeek's keep the embeddings and lm_head in bf16 too, but a folder may quantize them (transformers'
    modules_to_convert), and a bound must hold for every folder."""
    norms = args.dim + args.n_layers * (2 * args.dim + args.kv_lora_rank + args.q_lora_rank)
    routers = args.n_moe_layers * args.n_experts * (args.dim + 1)  # the gate and the expert bias
    return param_count(args) - norms - routers


def architecture(args: DeepseekV3Args) -> str:
    return ARCHITECTURE


def check_exportable(args: DeepseekV3Args) -> list[str]:
    """Raise a one-line ExportError for options without an exact target; return what to warn about."""
    for field, ok, fix in (("score_func", args.score_func == "sigmoid", "'sigmoid'"),
                           ("tie_word_embeddings", not args.tie_word_embeddings, "false"),
                           ("qk_norm", not args.qk_norm, "false"),
                           ("rope_scaling", args.rope_scaling is None, "'none'")):
        if not ok:
            raise ExportError(f"model.{field}={getattr(args, field)!r} has no mapping in {ARCHITECTURE}: train with "
                              f"model.{field}={fix} to export")
    notes = []
    if args.mtp_layers:
        notes.append(f"the {args.mtp_layers} MTP modules (layers.{args.n_layers}..) are not exported: transformers' "
                     f"{ARCHITECTURE} ignores them (num_nextn_predict_layers=0 is written)")
    if args.capacity_factor > 0:
        notes.append(f"capacity_factor={args.capacity_factor} (token dropping) has no counterpart in {ARCHITECTURE}: "
                     "the export routes every token, so its logits equal this model's with capacity_factor=0")
    return notes


def _attention_shapes(args: DeepseekV3Args, i: int) -> dict[str, tuple[int, ...]]:
    d, h, p = args.dim, args.n_heads, f"layers.{i}.attention"
    shapes: dict[str, tuple[int, ...]] = {f"layers.{i}.attention_norm.weight": (d,)}
    if args.q_lora_rank:
        shapes |= {f"{p}.q_a_proj.weight": (args.q_lora_rank, d), f"{p}.q_a_layernorm.weight": (args.q_lora_rank,),
                   f"{p}.q_b_proj.weight": (h * args.qk_head_dim, args.q_lora_rank)}
    else:
        shapes[f"{p}.q_proj.weight"] = (h * args.qk_head_dim, d)
    return shapes | {
        f"{p}.kv_a_proj_with_mqa.weight": (args.kv_lora_rank + args.qk_rope_head_dim, d),
        f"{p}.kv_a_layernorm.weight": (args.kv_lora_rank,),
        f"{p}.kv_b_proj.weight": (h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank),
        f"{p}.o_proj.weight": (d, h * args.v_head_dim),
        f"layers.{i}.mlp_norm.weight": (d,),
    }


def expected_shapes(args: DeepseekV3Args) -> dict[str, tuple[int, ...]]:
    """Every weight and expert bias a DeepseekV3 model with these args exports, by our fqn: the MoE family's with
    MLA's attention, the main blocks only (not the MTP modules, which the export leaves out)."""
    return moe.expected_shapes(args, attention=_attention_shapes)


def _interleave_rows(t: torch.Tensor, start: int, width: int, rope: int) -> torch.Tensor:
    """Within each block of `width` rows, the `rope` rows from `start`: ours (j, j + half) -> DeepSeek's interleaved
    (2j, 2j + 1). Row 2j of theirs is ours j, 2j + 1 ours j + half: the same rotation of q.k."""
    t = t.reshape(-1, width, t.shape[-1]).clone()
    part = t[:, start:start + rope]
    t[:, start:start + rope] = part.reshape(-1, 2, rope // 2, t.shape[-1]).transpose(1, 2).reshape(part.shape)
    return t.reshape(-1, t.shape[-1])


def _halve_rows(t: torch.Tensor, start: int, width: int, rope: int) -> torch.Tensor:
    """The inverse of `_interleave_rows`."""
    t = t.reshape(-1, width, t.shape[-1]).clone()
    part = t[:, start:start + rope]
    t[:, start:start + rope] = part.reshape(-1, rope // 2, 2, t.shape[-1]).transpose(1, 2).reshape(part.shape)
    return t.reshape(-1, t.shape[-1])


def _rope_rows(fqn: str, args: DeepseekV3Args) -> tuple[int, int] | None:
    """(start, block width) of the RoPE rows that `fqn`'s weight holds per block, or None."""
    if fqn.endswith((".attention.q_proj.weight", ".attention.q_b_proj.weight")):
        return args.qk_nope_head_dim, args.qk_head_dim  # each head: [nope | rope]
    if fqn.endswith(".attention.kv_a_proj_with_mqa.weight"):
        return args.kv_lora_rank, args.kv_lora_rank + args.qk_rope_head_dim  # [latent | the shared RoPE key]
    return None


def spec(fqn: str, args: DeepseekV3Args) -> Spec:
    """How our tensor `fqn` is stored in the safetensors (rope_interleave = true: the RoPE rows permuted)."""
    m = _LAYER.match(fqn)
    if m is not None and (a := re.fullmatch(r"attention\.(\w+)\.weight", m.group(2))) and a.group(1) in _MLA_NAMES:
        name = f"model.layers.{m.group(1)}.self_attn.{a.group(1)}.weight"
        rows = _rope_rows(fqn, args)
        if rows is None:
            return rename(name)
        start, width = rows
        r = args.qk_rope_head_dim
        return Spec((name,), lambda t: [_interleave_rows(t, start, width, r)],
                    lambda ts: _halve_rows(ts[0], start, width, r))
    if m is None or not m.group(2).startswith("moe."):
        return rename(to_hf_name(fqn))  # embeddings, block norms, dense blocks, head: Llama's names
    return moe.routed_spec(fqn, args, target=moe.GLM, kind="DeepSeek-V3")  # Glm4MoeMoE is DeepseekV3MoE


def hf_config(args: DeepseekV3Args, *, dtype: torch.dtype) -> dict:
    """config.json of DeepseekV3ForCausalLM (keys read by transformers 4.x and 5.x)."""
    config = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **common_config(args, dtype=dtype)}
    del config["head_dim"]  # transformers derives it (qk_rope_head_dim)
    config.update({
        "num_key_value_heads": args.n_heads, "q_lora_rank": args.q_lora_rank or None,
        **{key: getattr(args, field) for field, key in _KEYS.items()},
        "norm_topk_prob": args.route_norm, "rope_interleave": True, "attention_bias": False,
        "num_nextn_predict_layers": 0, "router_aux_loss_coef": args.aux_loss_coef,
    })
    if (y := args.rope_yarn) is not None:  # DeepSeek-V3's own configs: the scaled context, 40 x 4096
        config.update(rope_scaling=yarn_config(y),
                      max_position_embeddings=max(args.max_seq_len, int(y.factor * y.original_max_seq_len)))
    return config


def tied_by_default(config: dict) -> bool:
    return False


def _get(config: dict, key: str):
    value = config.get(key, _DEFAULTS.get(key))
    return _DEFAULTS.get(key) if value is None and key != "q_lora_rank" else value


def _yarn(config: dict, *, where: str) -> YarnScaling | None:
    """The YaRN of config.json's RoPE, None for plain RoPE; another scaling is refused in one line."""
    rope, _ = rope_fields(config, where=where)
    if (kind := rope_kind(rope)) not in ("default", "yarn"):
        raise ExportError(f"{where}: rope_type={kind!r}: this trainer's DeepSeek-V3 takes plain RoPE or 'yarn'")
    return yarn_of(config, rope, where=where) if kind == "yarn" else None


def _check_supported(config: dict, *, where: str) -> None:
    for key, ok in (("hidden_act", config.get("hidden_act", "silu") == "silu"),
                    ("attention_bias", not _get(config, "attention_bias")),
                    ("rope_interleave", _get(config, "rope_interleave"))):
        if not ok:
            raise ExportError(f"{where}: {key}={config.get(key)!r} has no equivalent in this trainer's DeepSeek-V3 "
                              "(it needs hidden_act='silu', no attention bias, rope_interleave=true: DeepSeek's own layout)")


def args_from_hf_config(config: dict, *, where: str) -> DeepseekV3Args:
    """DeepseekV3Args of a DeepseekV3 config.json (no MTP modules: their weights are skipped on import)."""
    if config.get("model_type") != MODEL_TYPE:
        raise ExportError(f"{where}: model_type={config.get('model_type')!r} is not {MODEL_TYPE!r}")
    keys = {**CONFIG_KEYS, **_KEYS, "q_lora_rank": "q_lora_rank"}
    del keys["n_kv_heads"]  # every MLA head has its own keys and values; num_key_value_heads is not read
    given = {**config, **{key: _get(config, key) for key in keys.values() if key in _DEFAULTS}}
    given["q_lora_rank"] = given.get("q_lora_rank") or 0
    check_config_values(given, keys, where=where, rules=_CONFIG_RULES)
    _check_supported(config, where=where)
    try:
        fields = decoder_fields({**config, "num_key_value_heads": config["num_attention_heads"]}, [])
        fields["dense_ffn_dim"] = int(config["intermediate_size"])
        for flavor in FLAVORS.values():  # a flavor's own FFN fields where they give this width
            if flavor.dim == fields["dim"] and flavor.ffn_dim == fields["dense_ffn_dim"]:
                fields.update(multiple_of=flavor.multiple_of, ffn_dim_multiplier=flavor.ffn_dim_multiplier,
                              dense_ffn_dim=flavor.dense_ffn_dim)
                break
        args = DeepseekV3Args(
            **fields, q_lora_rank=int(given["q_lora_rank"]), route_norm=bool(_get(config, "norm_topk_prob")),
            **{field: type(getattr(FLAVORS["debug_deepseek_v3"], field))(_get(config, key))
               for field, key in _KEYS.items()},
            aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0), bias_update_rate=0.0, mtp_layers=0,
            rope_yarn=_yarn(config, where=where),
        )
    except ExportError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: not a {MODEL_TYPE} config ({type(e).__name__}: {e})") from None
    return args


def check_hf_config(config: dict, args: DeepseekV3Args, *, where: str) -> None:
    """Raise ExportError naming the first config.json field whose weights or scores differ from args'."""
    theirs = args_from_hf_config(config, where=where)
    keys = {**CONFIG_KEYS, **_KEYS, "q_lora_rank": "q_lora_rank"}
    for field in _SHAPE_FIELDS:
        if getattr(theirs, field) != getattr(args, field):
            raise ExportError(f"{where}: {keys[field]}={getattr(theirs, field)} but the trainer model has "
                              f"{getattr(args, field)}")
    for field, key in (("rope_theta", "rope_theta"), ("rope_yarn", "rope_scaling")):
        if getattr(theirs, field) != getattr(args, field):
            raise ExportError(f"{where}: {key} gives {field}={getattr(theirs, field)} but the trainer model has "
                              f"{getattr(args, field)}")


def skip_headers(headers: dict[str, Header], args: DeepseekV3Args, *, where: str) -> dict[str, Header]:
    """The folder's tensors less its MTP modules' (`model.layers.{n >= num_hidden_layers}.*`), which transformers'
    DeepseekV3 ignores too; logs a note when there are any."""
    kept = {name: h for name, h in headers.items()
            if not ((m := _HF_LAYER.match(name)) and int(m.group(1)) >= args.n_layers)}
    if skipped := len(headers) - len(kept):
        logger.info("%s: skipped %d tensors of MTP modules (model.layers.%d and after): the imported model has no "
                    "MTP modules (model.mtp_layers=0), as transformers' %s loads it", where, skipped, args.n_layers,
                    ARCHITECTURE)
    return kept


def skip_weights(shapes: dict[str, tuple[int, ...]], args: DeepseekV3Args) -> dict[str, tuple[int, ...]]:
    """The model's weights less its MTP modules' (`layers.{n >= n_layers}.*`), which the export leaves out
    (`check_exportable` says so): what `write_hf_export` writes."""
    return {fqn: shape for fqn, shape in shapes.items()
            if not ((m := _OUR_LAYER.match(fqn)) and int(m.group(1)) >= args.n_layers)}


def with_routing_of(args: DeepseekV3Args, config: dict, *, where: str) -> DeepseekV3Args:
    """`args` with the routing of a config.json (the weights' shapes already checked equal)."""
    theirs = args_from_hf_config(config, where=where)
    return replace(args, top_k=theirs.top_k, route_norm=theirs.route_norm, n_group=theirs.n_group,
                   topk_group=theirs.topk_group, routed_scaling_factor=theirs.routed_scaling_factor)
