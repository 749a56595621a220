"""What a DeepSeek-V3 flavor allows of the layout and the config, and the [deepseek_v3] keys on other flavors: one
line each, before any process group (trainer.validate.layout.check_model_layout calls this).

Covered layouts (tests/distributed/test_deepseek_v3_layouts.py, against one process): FSDP2 (dp_shard, HSDP), expert,
tensor, context and pipeline parallelism, activation checkpointing, with MTP modules and without. Under pipeline
parallelism the last stage holds the MTP modules and a copy of the embeddings, whose gradient is summed with the first
stage's (trainer.parallel.pipeline); refused: the V schedule with MTP modules (it puts both ends on one rank).
"""

from __future__ import annotations

import dataclasses

from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.model_values import DeepseekV3Args, ModelArgs
from trainer.parallel import ParallelDims
from trainer.parallel.pipeline_layout import V_SCHEDULES


def check_deepseek_v3(cfg: JobConfig, args: ModelArgs, pd: ParallelDims) -> None:
    """ConfigError for a [deepseek_v3] key set on another family's flavor, and for what a DeepSeek-V3 model refuses."""
    if not isinstance(args, DeepseekV3Args):
        changed = [f.name for f in dataclasses.fields(cfg.deepseek_v3) if getattr(cfg.deepseek_v3, f.name) is not None]
        if changed:
            raise ConfigError(f"deepseek_v3.{changed[0]}={getattr(cfg.deepseek_v3, changed[0])} has no effect: "
                              f"model.flavor={cfg.model.flavor!r} is not a DeepSeek-V3 flavor; remove it or pick one "
                              "(debug_deepseek_v3, deepseek_v3_16b)")
        return
    if pd.pp > 1 and args.mtp_layers and cfg.distributed.pipeline_schedule in V_SCHEDULES:
        raise ConfigError(f"distributed.pipeline_schedule={cfg.distributed.pipeline_schedule!r} with "
                          f"deepseek_v3.mtp_layers={args.mtp_layers}: the V schedule puts the first and the last stage "
                          "on one rank, where the last stage's copy of the embeddings (for the MTP modules' tokens "
                          "ahead) would be a second table of the same name; use 'Interleaved1F1B' or "
                          "'InterleavedZeroBubble', or deepseek_v3.mtp_layers=0")
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
