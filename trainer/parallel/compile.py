"""torch.compile per transformer block and for the output head with its loss."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, *, compile_head: bool) -> str:
    """Compile each block (identical blocks share one compiled graph) and the head+loss.

    Blocks are compiled one by one, not the whole model, so FSDP2's per-block
    hooks stay outside the graphs and compile time does not grow with depth.
    The head is compiled with the loss so the logits never round-trip to memory
    in fp32 (at vocab 128256 that is most of the step's elementwise traffic); with
    `model.loss_chunk_tokens` one chunk of head and loss is compiled instead.
    """
    for name, block in list(model.layers.named_children()):
        # MoE blocks break the graph where the host needs token counts (EP split sizes,
        # token dropping); dense blocks compile whole.
        fullgraph = getattr(block, "moe", None) is None
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph))
    chunk = model.loss_chunk_tokens
    if compile_head and chunk:
        # One graph per chunk, the loop stays eager: compiled as one graph, inductor would schedule
        # every chunk's recomputed logits together in backward
        # (docs/benchmarks.md#memory-levers-chunked-loss-trainloss_chunk_tokens). dynamic=False:
        # a shorter last chunk gets a static graph of its own rather than a dynamic one for all.
        model.chunk_loss = torch.compile(model.chunk_loss, fullgraph=True, dynamic=False)
    elif compile_head:
        # Instance attribute shadows the method; state-dict keys are unchanged.
        model.head_loss = torch.compile(model.head_loss, fullgraph=True)
    if not compile_head:
        head = "(output head eager: loss parallel under TP)"
    elif chunk:
        head = f"and the output head with its loss, per chunk of {chunk} tokens"
    else:
        head = "and the output head with its loss"
    return f"torch.compile: {len(model.layers)} blocks {head}"
