"""Model families and their flavors. The family follows from `[model] flavor`: dense Llama 3 flavors
(`trainer.models.llama`), MoE flavors (`trainer.models.moe`), DeepSeek-V3 (`trainer.models.deepseek_v3`) and GPT-OSS
(`trainer.models.gpt_oss`); what differs between them is the `ModelFamily` of `trainer.models.family`, resolved from
the args by `family_of`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from trainer.model_values import DeepseekV3Args
from trainer.models.counts import mla_param_count
from trainer.models.family import FAMILIES, ModelFamily, family_of
from trainer.models.llama import Llama, ModelArgs, num_params
from trainer.models.llama import model_args_for as llama_args_for
from trainer.models.moe import MOE_FLAVORS, MoEArgs, MoETransformer, moe_args_for
from trainer.models.mtp import MTPLossMetrics, mtp_or_plain_loss_fn

FLAVORS: dict[str, ModelArgs] = {name: args for family in FAMILIES.values() for name, args in family.flavors.items()}


def model_args_for(flavor: str, *, vocab_size: int = 0, n_layers: int = 0, max_seq_len: int = 0,
                   **moe: Any) -> ModelArgs:
    """A flavor's shapes with optional overrides (0 keeps the flavor's value); `moe` keys only for MoE flavors."""
    if flavor in MOE_FLAVORS:
        return moe_args_for(flavor, vocab_size=vocab_size, n_layers=n_layers, max_seq_len=max_seq_len, **moe)
    if isinstance(FLAVORS.get(flavor), MoEArgs):  # another routed family's (deepseek_v3, gpt_oss)
        args = replace(FLAVORS[flavor], **{k: v for k, v in {"vocab_size": vocab_size, "n_layers": n_layers}.items()
                                           if v}, **moe)
        return replace(args, max_seq_len=max(max_seq_len, args.max_seq_len))
    if flavor not in FLAVORS:
        raise ValueError(f"model.flavor={flavor!r} is not one of {', '.join(repr(f) for f in FLAVORS)}")
    assert not moe, f"MoE options {sorted(moe)} given for the dense flavor {flavor!r}"
    return llama_args_for(flavor, vocab_size=vocab_size, n_layers=n_layers, max_seq_len=max_seq_len)


def is_moe(args: ModelArgs) -> bool:
    """Whether the model routes tokens to experts (`family_of(args).has_router`)."""
    return family_of(args).has_router


def build_model(args: ModelArgs) -> nn.Module:
    """The family's model for these args (call under `torch.device("meta")` to allocate nothing)."""
    return family_of(args).build(args)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token for MFU; MoE models count their ACTIVE parameters."""
    return family_of(args).flops_per_token(args, seq_len)


def param_counts(args: ModelArgs) -> tuple[int, int]:
    """(total, active) parameters: active = what one token passes through, without the embedding table."""
    return family_of(args).param_counts(args)


def pipeline_costs(args: ModelArgs, seq_len: int) -> tuple[float, list[float], float]:
    """Training FLOPs per token of (the embedding, each block, the final norm + output head): what the automatic
    pipeline split balances. They sum to `flops_per_token` (6 x the matmul parameters a token passes through,
    MoE blocks counting the top_k routed experts, plus the attention term per block); the embedding is a
    lookup, 0 FLOPs. DeepSeek-V3's MTP modules count with the head: the last stage runs them."""
    attn = args.dim * args.head_dim * (args.n_heads + 2 * args.n_kv_heads) + args.n_heads * args.head_dim * args.dim
    attention = 12 * args.n_heads * args.head_dim * seq_len
    if isinstance(args, DeepseekV3Args):  # MLA: its projections; QK^T over qk_head_dim, AV over v_head_dim
        attn, attention = mla_param_count(args), 6 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    norms = 2 * args.dim
    ffn_params = family_of(args).ffn_params
    blocks = [6.0 * (attn + ffn_params(args, i) + norms) + attention for i in range(args.n_layers)]
    head = 6.0 * (args.dim + args.dim * args.vocab_size)
    if getattr(args, "mtp_layers", 0):  # DeepSeek-V3's MTP modules run on the last stage, with the head
        head += flops_per_token(args, seq_len) - flops_per_token(replace(args, mtp_layers=0), seq_len)
    return 0.0, blocks, head


__all__ = [
    "FAMILIES", "FLAVORS", "Llama", "MTPLossMetrics", "MoEArgs", "MoETransformer", "ModelArgs", "ModelFamily",
    "build_model", "family_of", "flops_per_token", "is_moe", "model_args_for", "mtp_or_plain_loss_fn", "num_params",
    "param_counts", "pipeline_costs",
]
