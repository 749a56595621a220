"""Model families and their flavors. The family follows from `[model] flavor`:
dense Llama 3 flavors (`trainer.models.llama`) and MoE flavors (`trainer.models.moe`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from trainer.models.llama import FLAVORS as LLAMA_FLAVORS
from trainer.models.llama import Llama, ModelArgs, num_params
from trainer.models.llama import flops_per_token as dense_flops_per_token
from trainer.models.llama import model_args_for as llama_args_for
from trainer.models.moe import MOE_FLAVORS, MoEArgs, MoETransformer, moe_args_for, moe_flops_per_token, param_counts

FLAVORS: dict[str, ModelArgs] = {**LLAMA_FLAVORS, **MOE_FLAVORS}


def model_args_for(flavor: str, *, vocab_size: int = 0, n_layers: int = 0, max_seq_len: int = 0,
                   **moe: Any) -> ModelArgs:
    """A flavor's shapes with optional overrides (0 keeps the flavor's value); `moe` keys only for MoE flavors."""
    if flavor in MOE_FLAVORS:
        return moe_args_for(flavor, vocab_size=vocab_size, n_layers=n_layers, max_seq_len=max_seq_len, **moe)
    if flavor not in FLAVORS:
        raise ValueError(f"model.flavor={flavor!r} is not one of {', '.join(repr(f) for f in FLAVORS)}")
    assert not moe, f"MoE options {sorted(moe)} given for the dense flavor {flavor!r}"
    return llama_args_for(flavor, vocab_size=vocab_size, n_layers=n_layers, max_seq_len=max_seq_len)


def is_moe(args: ModelArgs) -> bool:
    return isinstance(args, MoEArgs)


def build_model(args: ModelArgs) -> nn.Module:
    """The family's model for these args (call under `torch.device("meta")` to allocate nothing)."""
    return MoETransformer(args) if is_moe(args) else Llama(args)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token for MFU; MoE models count their ACTIVE parameters."""
    return moe_flops_per_token(args, seq_len) if is_moe(args) else dense_flops_per_token(args, seq_len)


__all__ = [
    "FLAVORS", "Llama", "MoEArgs", "MoETransformer", "ModelArgs", "build_model", "flops_per_token", "is_moe",
    "model_args_for", "num_params", "param_counts",
]
