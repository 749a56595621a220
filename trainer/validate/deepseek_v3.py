"""What a DeepSeek-V3 flavor allows of the layout and the config, and the [deepseek_v3] keys on other flavors: one
line each, before any process group (trainer.validate.layout.check_model_layout calls this).

Covered layouts (tests/distributed/test_deepseek_v3_layouts.py, against one process): FSDP2 (dp_shard, HSDP), expert
parallelism (ep), activation checkpointing; pipeline and context parallelism without MTP modules. Refused: tensor
parallel (MLA's projections have no plan yet: q_a_proj and kv_a_proj_with_mqa feed norms over their whole width, so
they would stay replicated with gradients summed over tp, which no plan here does), and pipeline or context parallel
with MTP modules (an MTP module needs the main model's last states, the embeddings and the head on one stage, and the
embedding k tokens ahead, which under cp another rank's chunk holds).
"""

from __future__ import annotations

import dataclasses

from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.model_values import DeepseekV3Args, ModelArgs
from trainer.parallel import ParallelDims


def check_deepseek_v3(cfg: JobConfig, args: ModelArgs, pd: ParallelDims) -> None:
    """ConfigError for a [deepseek_v3] key set on another family's flavor, and for what a DeepSeek-V3 model refuses."""
    if not isinstance(args, DeepseekV3Args):
        changed = [f.name for f in dataclasses.fields(cfg.deepseek_v3) if getattr(cfg.deepseek_v3, f.name) is not None]
        if changed:
            raise ConfigError(f"deepseek_v3.{changed[0]}={getattr(cfg.deepseek_v3, changed[0])} has no effect: "
                              f"model.flavor={cfg.model.flavor!r} is not a DeepSeek-V3 flavor; remove it or pick one "
                              "(debug_deepseek_v3, deepseek_v3_16b)")
        return
    if pd.pp > 1 and args.mtp_layers:
        raise ConfigError(f"distributed.pp={pd.pp} with deepseek_v3.mtp_layers={args.mtp_layers}: the MTP modules and "
                          "their loss need the main model's last states, embeddings and head on one stage; set "
                          "deepseek_v3.mtp_layers=0 or distributed.pp=1")
    if args.rope_scaling is not None:
        raise ConfigError(f"model.rope_scaling={args.rope_scaling.kind!r} with the DeepSeek-V3 flavor "
                          f"{cfg.model.flavor!r}: Llama 3's RoPE scaling is not DeepSeek-V3's; set "
                          "model.rope_scaling='none' (its long-context RoPE is YaRN: deepseek_v3.rope_yarn)")
    # resolved.toml writes head_dim as the value in effect, qk_rope_head_dim (the RoPE table's width): that one is no
    # other setting.
    head_dim = args.explicit_head_dim not in (0, args.qk_rope_head_dim)
    for key, value, ignored, fix in (
            ("model.head_dim", args.explicit_head_dim, head_dim, "deepseek_v3.qk_nope_head_dim and qk_rope_head_dim"),
            ("model.n_kv_heads", args.n_kv_heads, args.n_kv_heads != args.n_heads, f"model.n_kv_heads={args.n_heads}"),
            ("model.qk_norm", "true", args.qk_norm, "model.qk_norm=false")):
        if ignored:
            raise ConfigError(f"{key}={value} with the DeepSeek-V3 flavor {cfg.model.flavor!r}: MLA has no such "
                              "setting (each head's widths are deepseek_v3 keys, every head has its own keys and "
                              f"values from the latent, no q/k norm); set {fix} instead")
    for key, value, set_ in (("moe.sparse_step", args.sparse_step, args.sparse_step != 1),
                             ("moe.dense_layers", list(args.dense_layers), bool(args.dense_layers))):
        if set_:
            raise ConfigError(f"{key}={value} with the DeepSeek-V3 flavor {cfg.model.flavor!r}: its dense blocks are "
                              "the leading ones (first_k_dense_replace); use moe.n_dense_layers and leave "
                              f"{key} unset")
    if args.score_func != "sigmoid":
        raise ConfigError(f"moe.score_func={args.score_func!r} with the DeepSeek-V3 flavor {cfg.model.flavor!r}: its "
                          "groups are ranked by sigmoid scores (DeepseekV3ForCausalLM's router); set "
                          "moe.score_func='sigmoid'")
