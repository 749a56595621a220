"""torch.compile per transformer block and for the output head with its loss."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, *, compile_head: bool) -> str:
    """Compile each block (identical blocks share one compiled graph) and the head+loss.

    Blocks are compiled one by one, not the whole model, so FSDP2's per-block
    hooks stay outside the graphs and compile time does not grow with depth.
    The head is compiled with the loss so the logits never round-trip to memory
    in fp32 (at vocab 128256 that is most of the step's elementwise traffic).
    """
    for name, block in list(model.layers.named_children()):
        # MoE blocks break the graph where the host needs token counts (EP split sizes,
        # token dropping); dense blocks compile whole.
        fullgraph = getattr(block, "moe", None) is None
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph))
    if compile_head:
        # Instance attribute shadows the method; state-dict keys are unchanged.
        model.head_loss = torch.compile(model.head_loss, fullgraph=True)
    head = "and the output head with its loss" if compile_head else "(output head eager: loss parallel under TP)"
    return f"torch.compile: {len(model.layers)} blocks {head}"
