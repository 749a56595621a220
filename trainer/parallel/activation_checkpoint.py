"""Activation checkpointing per transformer block."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Ops whose outputs selective AC keeps: the expensive ones to recompute.
# Everything else (norms, activations, rope, casts) is recomputed in backward.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._grouped_mm.default,  # MoE routed experts
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
if hasattr(torch.ops.higher_order, "flex_attention"):  # document masking's attention on a GPU
    _SAVE_OPS.add(torch.ops.higher_order.flex_attention)
if hasattr(torch.ops.aten, "_scaled_mm_v2"):  # F.scaled_mm's op (torch >= 2.10): the blockwise recipe's GEMMs
    _SAVE_OPS.add(torch.ops.aten._scaled_mm_v2.default)


def _op_policy_context():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, *, mode: Literal["none", "selective", "full"], selective_every: int = 0) -> str:
    """Wrap blocks in `model.layers` with checkpoint_wrapper; returns a one-line description.

    selective with selective_every=0 uses the per-op policy above on every block;
    selective_every=N fully checkpoints every Nth block and leaves the others alone.
    """
    if mode == "none":
        return "activation checkpointing: none"
    counts: Counter[str] = Counter()
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
            counts["full"] += 1
        elif selective_every > 0:
            if i % selective_every:
                continue
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
            counts["full"] += 1
        else:
            wrapped = checkpoint_wrapper(block, context_fn=_op_policy_context, preserve_rng_state=False)
            counts["op-policy"] += 1
        model.layers.register_module(name, wrapped)
    kind = f"selective every {selective_every}" if mode == "selective" and selective_every else mode
    return f"activation checkpointing: {kind} on {sum(counts.values())}/{len(model.layers)} blocks"
