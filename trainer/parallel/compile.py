"""torch.compile per transformer block (the loss compiles in trainer/loss.py)."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, *, context_parallel: bool) -> str:
    """Compile each block; identical blocks share one compiled graph.

    Blocks are compiled one by one, not the whole model, so FSDP2's per-block hooks stay
    outside the graphs and compile time does not grow with depth. The final norm, output
    head and loss are compiled together by `trainer.loss.LossFn`, so the logits never
    round-trip to memory in fp32 (at vocab 128256 that is most of the step's elementwise traffic).
    context_parallel: the model's attention runs the K/V all-gather (trainer.parallel.context_parallel).
    """
    for name, block in list(model.layers.named_children()):
        # MoE blocks break the graph where the host needs token counts (EP split sizes,
        # token dropping), context parallel around its attention; dense blocks compile whole.
        fullgraph = getattr(block, "moe", None) is None and not context_parallel
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph))
    return f"torch.compile: {len(model.layers)} blocks"
