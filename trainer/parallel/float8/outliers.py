"""Outlier features at the FP8 stats steps: the kurtosis of each transformer block's input, and a warning above
metrics.kurtosis_warn.

The definition is FOG's (Hernandez-Cano et al., "Towards Fully FP8 GEMM LLM Training at Scale", arXiv 2505.20524),
which tracks it to see outliers build up and predict divergences, taken from He et al., "Understanding and Minimising
Outlier Features in Neural Network Training" (arXiv 2405.19279: "the kurtosis over neuron activation norms"). For the
activations X (N tokens x d channels) entering a block:

    s_j     = sqrt(mean_i X_ij^2)                      channel j's RMS over the tokens
    Kurt(X) = mean_j s_j^4 / (mean_j s_j^2)^2          the (uncentred) kurtosis of those d RMS values

It is 1 when every channel has the same RMS and d when one channel holds all of it; one channel with r times the RMS
of the d - 1 others gives d (d - 1 + r^4) / (d - 1 + r^2)^2 (about 2,000 at d = 4096, r = 100). It measures what a
tensorwise FP8 scale suffers from: a few channels much larger than the rest stretch the one scale all channels share
(a massive activation on a few tokens raises it too, through its channel's RMS). It is not the per-channel kurtosis of
the values over tokens (E[(x - mean)^4] / E[(x - mean)^2]^2 of one channel, then the max over channels): that is
large for a channel where a few tokens spike even when every channel has the same scale, and misses a channel that is
large for every token.

N is every token this rank's stats step runs through the block (every microbatch); with activation checkpointing a
recomputed forward counts each microbatch again, which the ratio does not see (it is invariant to counting every token
k times). Recorded only while the stats step runs: one d-vector of sums of squares per block on the device, read back
once at the log step, like the other FP8 health stats (this rank's tokens and blocks; a pipeline rank logs its stage's).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.log import EVERY_RANK
from trainer.models.layers import TransformerBlock, clean_fqn

logger = logging.getLogger(__name__)


def channel_kurtosis(sum_squares: torch.Tensor) -> torch.Tensor:
    """Kurt(X) from each channel's sum of squares over the tokens, q_j = N s_j^2 (N cancels): d sum q_j^2 / (sum q_j)^2,
    in float64. 0 for all-zero activations (no channel stands out)."""
    q = sum_squares.double()
    return q.numel() * (q * q).sum() / q.sum().square().clamp(min=torch.finfo(torch.float64).tiny)


def kurtosis_of(x: torch.Tensor) -> torch.Tensor:
    """Kurt of activations `x` (..., d): its tokens are every index but the last."""
    return channel_kurtosis(x.detach().reshape(-1, x.shape[-1]).double().square().sum(0))


class BlockInputKurtosis:
    """Kurt of every transformer block's input (`layers.{i}`; an MTP module's too) over the steps run inside
    `collect()`; `report()` logs it and warns above `warn_above` (0 = never)."""

    def __init__(self, model: nn.Module, *, warn_above: float):
        # A block's own fqn ends in the wrapper's name where AC or compile wrapped it (`layers.0._orig_mod`).
        self.blocks = {clean_fqn(f"{fqn}.").rstrip("."): m for fqn, m in model.named_modules()
                       if isinstance(m, TransformerBlock)}
        self.warn_above = warn_above
        self._sums: dict[str, torch.Tensor] = {}

    def _record(self, fqn: str, x: torch.Tensor) -> None:
        local = x.to_local() if isinstance(x, DTensor) else x  # this rank's tokens (a sequence-parallel shard)
        # float32 squares summed into float64: a d-vector per block, on the device (no host sync).
        q = local.detach().reshape(-1, local.shape[-1]).float().square().sum(0, dtype=torch.float64)
        self._sums[fqn] = self._sums[fqn] + q if fqn in self._sums else q

    @contextlib.contextmanager
    def collect(self):
        handles = [block.register_forward_pre_hook(lambda m, args, fqn=fqn: self._record(fqn, args[0]))
                   for fqn, block in self.blocks.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def report(self) -> dict[str, float]:
        """`fp8_health/block_input/{fqn}/kurtosis` per block and `fp8_health/block_input/kurtosis_max`; one warning
        naming the worst block above the threshold. One host sync; clears what was collected."""
        if not self._sums:
            return {}
        fqns = sorted(self._sums, key=_block_order)
        values = torch.stack([channel_kurtosis(self._sums[fqn]) for fqn in fqns]).tolist()
        self._sums.clear()
        out = {f"fp8_health/block_input/{fqn}/kurtosis": v for fqn, v in zip(fqns, values)}
        worst, highest = max(zip(fqns, values), key=lambda item: item[1])
        out["fp8_health/block_input/kurtosis_max"] = highest
        above = [fqn for fqn, v in zip(fqns, values) if v > self.warn_above]
        if self.warn_above and above:
            logger.warning(
                "outlier features: %s's input has a channel kurtosis of %.4g, above metrics.kurtosis_warn=%g (%d of %d "
                "blocks are): a few channels carry most of the activations' scale, which a tensorwise FP8 scale "
                "shares with every channel (FOG, arXiv 2505.20524, sees this grow before FP8 runs diverge)", worst,
                highest, self.warn_above, len(above), len(fqns), extra=EVERY_RANK)  # this rank's tokens and blocks
        return out


def _block_order(fqn: str) -> tuple[int, str]:
    """`layers.10` after `layers.9`."""
    index = fqn.split(".")[1] if fqn.startswith("layers.") else ""
    return (int(index), fqn) if index.isdigit() else (-1, fqn)
