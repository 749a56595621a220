"""The LM loss every layout shares: final norm -> output head -> cross-entropy in fp32.

A model (`trainer.models.layers.Decoder.forward`), and each pipeline stage, returns hidden
states; `LossFn` applies the final norm and output head of the module that holds them and
computes the loss over all tokens at once, or `chunk_tokens` at a time. Labels equal to
IGNORE_INDEX (the token after an EOS under data.eod_mask_loss) count nowhere: `LossFn.sum` is the
summed loss of the valid labels, which the step divides by the valid labels of the whole global
batch (trainer/run/step.py); `LossFn(h, labels)` is their mean. The trainer calls the
same object at pp=1 (trainer/run/step.py) and the pipeline schedule calls it on the last stage
(trainer/parallel/pipeline.py), so the chunked loss and compile behave the same in every
layout. The MoE auxiliary loss is not computed here: each MoE layer injects its gradient
through autograd (`trainer.models.moe.attach_aux_loss`).

Under FSDP2 the norm and head weights belong to the root unit, which stays gathered from its
forward until its backward (FSDP2 never reshards the root after forward), so the loss may use
them after the model's forward has returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""A label that is not trained on (F.cross_entropy's default ignore_index)."""


# Inductor options of the head-and-loss graphs: no autotuning of pointwise kernels, as the blocks'
# (trainer/parallel/compile.py). On 1x H200 (8B shapes x 8 layers, fp8, cold caches, alternated with the default)
# it cut autotuning from 1.7-2.0 s to 0.4 s, step 1 came 29.4-31.6 s after the launch against 34.3-40.1 s, and
# the steps ran at the default's speed (docs/benchmarks.md#cold-start).
LOSS_INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False}


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: under TP's loss_parallel it is a DTensor replicated over the tp ranks."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


class LossFn:
    """`loss_fn.sum(h, labels)`: the summed cross-entropy of `output_head(norm(h))` against the valid labels (not
    IGNORE_INDEX), in fp32; `loss_fn(h, labels)`: their mean."""

    def __init__(self, norm: nn.Module, output_head: nn.Module, *, chunk_tokens: int = 0, compile: bool = False):
        self.norm, self.output_head = norm, output_head
        self.chunk_tokens = chunk_tokens
        self.head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._head_loss_sum
        self.chunk_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._chunk_loss
        if compile and chunk_tokens:
            # One graph per chunk, the loop stays eager: compiled as one graph, inductor would schedule
            # every chunk's recomputed logits together in backward
            # (docs/benchmarks.md#memory-levers-chunked-loss-trainloss_chunk_tokens). dynamic=False:
            # a shorter last chunk gets a static graph of its own rather than a dynamic one for all.
            self.chunk_loss = torch.compile(self._chunk_loss, fullgraph=True, dynamic=False,
                                            options=LOSS_INDUCTOR_OPTIONS)
        elif compile:
            # Norm, head and loss in one graph: the fp32 upcast of the logits fuses into the cross-entropy.
            self.head_loss = torch.compile(self._head_loss_sum, fullgraph=True, options=LOSS_INDUCTOR_OPTIONS)

    def sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed loss of the valid labels (a replicated DTensor under TP's loss_parallel)."""
        if self.chunk_tokens:
            return chunked_cross_entropy(self.chunk_loss, h, labels, chunk_tokens=self.chunk_tokens)
        return self.head_loss(h, labels)

    @torch.no_grad()
    def row_sums(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[batch] the summed loss of each row's valid labels (h [batch, seq, dim], labels [batch, seq]), in fp32, for
        scoring (trainer/run/tasks.py): eager, forward only, `chunk_tokens` tokens' rows at a time where set (at
        least one row). Under TP's loss_parallel the per-token losses are replicated over the tp ranks."""
        assert h.shape[0] == labels.shape[0], "main states only: an MTP model evaluates without its MTP modules"
        rows = max(1, self.chunk_tokens // labels.shape[1]) if self.chunk_tokens else labels.shape[0]
        sums = []
        for h_rows, label_rows in zip(h.split(rows), labels.split(rows)):
            logits = self.output_head(self.norm(h_rows))
            nll = F.cross_entropy(logits.flatten(0, -2).float(), label_rows.flatten(), reduction="none",
                                  ignore_index=IGNORE_INDEX)
            nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
            sums.append(nll.view(label_rows.shape).sum(-1))
        return torch.cat(sums)

    def __call__(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss over the valid labels (F.cross_entropy's mean)."""
        return local_loss(self.sum(h, labels)) / (labels != IGNORE_INDEX).sum().clamp(min=1)

    def _chunk_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of tokens h [n, dim], activation-checkpointed.

        Only h and labels are saved for backward: the logits are freed when forward returns and
        made again when backward reaches this chunk (one more head GEMM). torch.compile compiles
        this function, not the loop over chunks (see __init__).
        """
        return checkpoint(self._head_loss_sum, h, labels, use_reentrant=False)

    def _head_loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """h [..., dim], labels [...]: the summed loss of the valid labels."""
        logits = self.output_head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum",
                               ignore_index=IGNORE_INDEX)


def build_loss_fn(model: nn.Module, *, chunk_tokens: int, compile: bool) -> LossFn:
    """The loss of the model (or last pipeline stage) that holds `norm` and `output_head`; logs what it does.

    compile=False under tensor parallel: the vocabulary-parallel loss runs eagerly there.
    """
    assert model.output_head is not None, "the loss needs the module with the output head (the last stage)"
    if chunk_tokens:
        logger.info("output head + loss: chunks of %d tokens, each activation-checkpointed (the head GEMM runs "
                    "again in backward)%s", chunk_tokens, ", compiled per chunk" if compile else "")
    elif compile:
        logger.info("torch.compile: the final norm, output head and loss as one graph (pointwise kernels not autotuned)")
    return LossFn(model.norm, model.output_head, chunk_tokens=chunk_tokens, compile=compile)


def chunked_cross_entropy(
    chunk_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
) -> torch.Tensor:
    """The summed loss of the valid labels of h [batch, seq, dim], chunk_tokens tokens at a time.

    chunk_loss maps tokens [n, dim] and labels [n] to their summed loss, so this equals the plain
    summed loss up to fp32 summation order; the last chunk may be shorter.
    """
    h, labels = h.flatten(0, 1), labels.flatten()
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    # split, not slicing: its backward concatenates the chunks' gradients once, where each
    # slice's backward would write a zero-padded gradient the size of all of h.
    for h_chunk, labels_chunk in zip(h.split(chunk_tokens), labels.split(chunk_tokens)):
        total = total + chunk_loss(h_chunk, labels_chunk)
    return total
