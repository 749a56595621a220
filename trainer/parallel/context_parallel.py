"""Context parallelism: each rank of the `cp` mesh holds two chunks of every sequence and attends over all of it.

A sequence of S tokens (its labels already shifted by the data loader) is cut into 2N chunks
of S / 2N tokens for N = cp; rank i holds chunks i and 2N-1-i, so every rank gets one early
and one late chunk and the causal attention work is the same on every rank (the Llama 3
paper's layout). Everything but attention is per token and runs on the local chunks as it
would on a whole sequence: RoPE takes the chunks' global positions, the loss is each rank's
mean over its tokens, and FSDP, which shards over `dp_shard x cp`, averages the cp ranks'
gradients, so the step's gradient is that of the mean over every token (the log averages the
losses the same way).

Attention all-gathers K and V over the cp group (`all_gather_tensor_autograd`: its backward
reduce-scatters their gradients) and attends each local query chunk to the keys before and on
its own chunk, a lower-right-aligned causal mask. With GQA the gathered K/V are n_kv_heads wide
(2 x S x kv_heads x head_dim values per layer, 8 kv heads for Llama 3 8B against 32 query
heads), which is what makes the all-gather cheap next to the attention it feeds
(docs/distributed.md#context-parallel). Runs on any backend: gloo on CPU, NCCL on GPU, where
SDPA runs the lower-right causal mask on its flash kernels.

Under document masking (data.document_masking) the model hands the attention a mask of the local queries
against the whole sequence's keys, made from the whole rows' documents (trainer.models.documents); it replaces
the lower-right causal masks.

The MoE sequence-wise aux loss sums its per-sequence statistics over the cp group (with
gradients, `MoE.set_sequence_group`) and injects N times its gradient on every rank, since FSDP
averages over the cp ranks a loss each of them holds whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from trainer.models.documents import masked_attention
from trainer.models.moe import MoE


@dataclass
class ContextParallel:
    """This rank's place in the cp group and the chunk layout; what the model reads."""

    group: dist.ProcessGroup
    rank: int
    size: int
    _positions: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)
    _orders: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of_mesh(cls, cp_mesh: DeviceMesh) -> ContextParallel:
        return cls(group=cp_mesh.get_group(), rank=cp_mesh.get_local_rank(), size=cp_mesh.size())

    def chunks(self) -> tuple[int, int]:
        """The two chunks (of 2 x size) this rank holds, in the order it holds them."""
        return self.rank, 2 * self.size - 1 - self.rank

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of a whole-sequence tensor, along `dim`."""
        chunk = x.shape[dim] // (2 * self.size)
        first, second = self.chunks()
        return torch.cat([x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)], dim=dim)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequences [batch, S] of this rank's chunks [batch, 2c] of every rank's (token ids or labels:
        an all-gather over the cp group, without gradient); the inverse of `shard`."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        batch, chunk = x.shape[0], x.shape[1] // 2
        slots = torch.stack(parts, dim=1).view(batch, 2 * self.size, chunk)  # rank order: chunks r and 2N-1-r
        return slots.index_select(1, self._chunk_order(x.device)).view(batch, 2 * self.size * chunk)

    def _chunk_order(self, device: torch.device) -> torch.Tensor:
        """gathered_chunk_order on `device`, made once (a copy from the host waits for the device), cached."""
        if (key := str(device)) not in self._orders:
            self._orders[key] = torch.tensor(gathered_chunk_order(self.size), device=device)
        return self._orders[key]

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens (for RoPE), cached."""
        key = (local_len, str(device))
        if key not in self._positions:
            chunk = local_len // 2
            first, second = self.chunks()
            self._positions[key] = torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                                              torch.arange(second * chunk, (second + 1) * chunk)]).to(device)
        return self._positions[key]


def gathered_chunk_order(size: int) -> list[int]:
    """Where each global chunk lands in the all-gather (rank r contributes chunks r and 2N-1-r, in rank order):
    entry g is the gathered slot of global chunk g."""
    slots = {}
    for r in range(size):
        slots[r], slots[2 * size - 1 - r] = 2 * r, 2 * r + 1
    return [slots[g] for g in range(2 * size)]


def lower_right_masks(chunk: int, chunks: tuple[int, int]) -> tuple:
    """SDPA's lower-right causal masks of the two query chunks (`causal_lower_right`: no mask tensor is made;
    on CUDA the flash kernel runs it). Made once, outside any forward: they are tensor subclasses, which
    selective activation checkpointing's dispatch mode refuses to see created."""
    return tuple(causal_lower_right(chunk, (j + 1) * chunk) for j in chunks)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunks: tuple[int, int],
                    masks: tuple | None = None) -> torch.Tensor:
    """Causal attention of two query chunks against the whole sequence's keys.

    q [batch, heads, 2c, head_dim]: chunks `chunks` of the sequence; k, v [batch, kv_heads, S, head_dim] in
    global order. Query chunk j attends to keys [0, (j+1)c), its own chunk causally (lower-right aligned;
    `masks` from `lower_right_masks`, made here when not given). Pure math on local tensors: the GPU test
    runs every rank's share of a sequence with it in one process.
    """
    c = q.shape[2] // 2
    masks = masks or lower_right_masks(c, chunks)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for half, (j, mask) in enumerate(zip(chunks, masks)):
        qj = q[:, :, half * c:(half + 1) * c]
        end = (j + 1) * c
        outs.append(F.scaled_dot_product_attention(qj, k[:, :, :end], v[:, :, :end], attn_mask=mask, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


class CPAttention:
    """The attention core of one Attention module under context parallelism (set by apply_cp)."""

    def __init__(self, cp: ContextParallel, *, seq_len: int):
        self.cp = cp
        self.order = torch.tensor(gathered_chunk_order(cp.size))
        self.masks = lower_right_masks(seq_len // (2 * cp.size), cp.chunks())

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's chunks of K and V [batch, kv_heads, 2c, head_dim] -> the whole sequence's, in its order (an
        attention of its own, GPT-OSS's with sinks, attends to them: trainer.models.gpt_oss)."""
        n = self.cp.size
        # Sequence first: the autograd all-gather concatenates along dim 0.
        k_all, v_all = (_all_gather_autograd(t.movedim(2, 0).contiguous(), self.cp.group).movedim(0, 2)
                        for t in (k, v))
        b, h, s, d = k_all.shape
        order = self.order.to(k.device)
        # Gathered chunks come in rank order (0, 2N-1, 1, 2N-2, ...): back to the sequence's order.
        return tuple(t.view(b, h, 2 * n, s // (2 * n), d).index_select(2, order).view(b, h, s, d)
                     for t in (k_all, v_all))

    @torch.compiler.disable  # builds SDPA's causal-bias object, which dynamo cannot trace; the block breaks here
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        """mask: None (causal), or a document mask of the local queries against the whole sequence's keys
        (trainer.models.documents.attention_mask with this rank's query positions)."""
        k_all, v_all = self.gather(k, v)
        assert q.shape[2] * self.cp.size == k_all.shape[2], "a sequence of another length than train.seq_len"
        if mask is not None:  # the causal part is in the mask, made with the queries' global positions
            return masked_attention(q, k_all, v_all, mask)
        if q.is_cuda:  # SDPA runs the lower-right causal mask on its flash kernel: O(seq) saved for backward
            return chunk_attention(q, k_all, v_all, chunks=self.cp.chunks(), masks=self.masks)
        # Elsewhere SDPA materializes the mask and saves the probabilities (seq^2): recompute them in backward.
        return checkpoint(chunk_attention, q, k_all, v_all, chunks=self.cp.chunks(), masks=self.masks,
                          use_reentrant=False)


def _all_gather_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 whose backward reduce-scatters the gradient (summed over the group)."""
    # torch 2.13 names it all_gather_single_autograd (the older name warns there); torch 2.11 has the older one.
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return funcol.wait_tensor(gather(x, 0, group))


def apply_cp(model: nn.Module, cp: ContextParallel, *, seq_len: int) -> str:
    """Context parallelism with the layout `cp` for sequences of seq_len tokens, in place: global RoPE positions,
    the K/V all-gather attention, and the MoE layers' aux loss over whole sequences. Before TP/EP, FP8, AC,
    compile and FSDP2 wrap the model. The step cuts each batch to this rank's chunks (trainer.run.step.TrainStep)."""
    model.set_context_parallel(cp)
    num_attention = num_moe = 0
    for module in model.modules():
        if hasattr(module, "attention_core"):
            module.attention_core = CPAttention(cp, seq_len=seq_len)
            num_attention += 1
        if isinstance(module, MoE):
            # FSDP averages over the cp ranks a loss each of them holds whole: cp times the aux loss's gradient.
            module.set_sequence_group(cp.group, aux_grad_multiplier=float(cp.size))
            num_moe += 1
    first, second = cp.chunks()
    return (f"context parallel: cp={cp.size}, this rank holds chunks {first} and {second} of {2 * cp.size} of every "
            f"sequence; K/V all-gathered in {num_attention} attention layers"
            + (f"; {num_moe} MoE layers balance over whole sequences" if num_moe else ""))
