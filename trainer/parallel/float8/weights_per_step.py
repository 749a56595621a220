"""float8.weights_per_step: each FP8 Linear's weight cast to FP8 once per optimizer step, not once per use.

Without it a tensorwise or blockwise FP8 Linear casts its bf16 weight (amax, scale, cast) in every forward, again in
every backward (the dgrad GEMM's operand) and again in the recompute of activation checkpointing: with N accumulation
(or pipeline) microbatches, 2N or 3N casts of a weight that does not change within the step. `Fp8WeightsPerStep`
(a step hook, trainer/hooks.py) casts every converted Linear's weight once when the step starts
(`step_context`) and hands it to the Linear (`Float8TensorwiseLinear.fp8_weight`, `BlockwiseFloat8Linear.fp8_weight`),
whose forwards, backwards and recomputes multiply it; the copies are dropped when the step's forward/backward ends
(`after_forward_backward`, before the optimizer changes the weights, so the optimizer step's peak does not hold
them) and, whatever happens, when the step's context exits. Nothing outside a step ever sees one: an evaluation
between steps (with train.ema_decay's average swapped in, or in bf16) casts what it multiplies, as before. So a
kept cast can never be stale: it is made from the weights of the step that uses it, after any checkpoint load or
precision-schedule rebuild (a new model, new hooks), and gone before the optimizer moves them.

Bit-equal to casting per use: dynamic tensorwise scaling derives the scale from the weight's amax, and the
weight (the forward's bf16 copy: the master weight in FSDP2's param_dtype, exactly what its all-gather makes)
is the same all step; under delayed scaling the scale buffer only changes after the optimizer step, and the
kept amax is recorded by every forward as before. Blockwise (float8.recipe='blockwise', blockwise.py) scales each
128x128 block of the weight by its own amax, and its forward GEMM and input-gradient GEMM multiply the same blocks
(the dgrad reads them column-major: on a GPU one byte-copy of the kept cast per backward, no amax and no rounding),
so one cast per step serves both. Rowwise stays per use: torchao's forward scales the weight per output row and its
dgrad per input column, two different casts, so keeping them would hold 2 bytes per parameter, and both are made
inside torchao's own Linear (ours replaces it only for tensorwise).

Where: only where FSDP2 does not shard the Linears (their shard group is one rank: one process, HSDP/DDP-style
replicas, pipeline stages), so this rank's shard *is* the full weight and the cast needs no gather. Under
dp_shard x cp > 1 FSDP2 gathers each block's weights per microbatch (and again for backward when it reshards after
forward): keeping an FP8 copy of every gathered weight for the step would pin 1 byte per parameter of the whole
model that sharding exists to avoid, and float8.enable_fsdp_float8_all_gather already casts the shard once per
gather (1/N of the weight, scales precomputed once per step by `Float8ScalePrecompute`). Costs 1 byte per
converted weight parameter of this rank (blockwise: and one fp32 scale per 128x128 block) from the step's start to
the end of its backward (the memory plan's "FP8 weights kept through the step" row).

Under torch.compile the cast happens here, eagerly, outside every compiled graph; the blocks' graphs take the kept
tensors as inputs (one graph whether or not a step keeps them: dynamo guards on `fp8_weight` being None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trainer.distributed import plain_tensor
from trainer.hooks import StepHook
from trainer.models.layers import clean_fqn
from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear
from trainer.parallel.float8.options import kept_weight_bytes
from trainer.parallel.float8.tensorwise import Float8TensorwiseLinear

KeptLinear = Float8TensorwiseLinear | BlockwiseFloat8Linear


def kept_linears(model: nn.Module) -> dict[str, KeptLinear]:
    """fqn -> every tensorwise or blockwise FP8 Linear of `model` (the Linears whose weight cast can be kept)."""
    return {clean_fqn(fqn): m for fqn, m in model.named_modules()
            if isinstance(m, (Float8TensorwiseLinear, BlockwiseFloat8Linear))}


class Fp8WeightsPerStep(StepHook):
    """Cast every FP8 Linear's weight once when a step starts; drop the casts when its forward/backward ends.

    dtype: the dtype the Linears' forward sees their weight in (FSDP2's param_dtype: bf16 for fp8 runs).
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype):
        self.linears = list(kept_linears(model).values())
        self.dtype = dtype
        assert self.linears, "float8.weights_per_step resolved on, but this model part has no kept-cast FP8 Linear"

    @contextlib.contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        self.keep()
        try:
            yield
        finally:
            self.drop()

    def after_forward_backward(self, step: int) -> None:
        self.drop()  # before the optimizer step: the weights change and its peak does not hold the copies

    def keep(self) -> None:
        """Cast each Linear's weight: between steps FSDP2 holds the master shard, here the whole weight."""
        for m in self.linears:
            weight = plain_tensor(m.weight, local=True)
            # A shard of fewer rows would be cast with its own amax: never silently a different number.
            assert weight.shape == m.weight.shape, (
                f"float8.weights_per_step on an FSDP-sharded weight {tuple(weight.shape)} of {tuple(m.weight.shape)}")
            m.fp8_weight = m.cast_weight(weight.detach().to(self.dtype))

    def drop(self) -> None:
        for m in self.linears:
            m.fp8_weight = None

    @property
    def nbytes(self) -> int:
        """What the kept casts hold: 1 byte per weight element (blockwise: and its blocks' fp32 scales)."""
        return sum(kept_weight_bytes(m.weight.numel(), recipe="blockwise" if isinstance(m, BlockwiseFloat8Linear)
                                     else "tensorwise") for m in self.linears)
