"""Document masking (data.document_masking, Llama 3): attention stays inside each document of a packed sequence,
and RoPE positions restart at each document.

A document ends with its EOS token; the token after an EOS starts the next one. From a batch of token ids
[batch, seq] this module makes what the blocks need: each token's position in its document (RoPE's rows),
and the attention mask "causal and the same document" in the form the device's kernel takes:

- on a GPU, a FlexAttention BlockMask (`torch.nn.attention.flex_attention`, compiled: its kernel skips the
  blocks no query may see, so shorter documents cost less attention work than one causal sequence);
- on a CPU, a dense boolean mask [batch, 1, seq, seq] for scaled_dot_product_attention (FlexAttention has no
  CPU backward), exact and O(seq^2) in memory: for tests and small runs.

The documents always come from the whole rows' tokens: a pipeline stage after the first gets them beside its
hidden states (trainer.parallel.pipeline), and under context parallelism a rank's queries (its chunks, at their
global positions) are masked against the whole row's keys, which its attention core gathers
(trainer.parallel.context_parallel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def document_ids(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position in the document) of every token of tokens [batch, seq]; an EOS token belongs to
    the document it ends."""
    is_eos = tokens == eos_id
    docs = torch.cumsum(is_eos, dim=1) - is_eos.long()  # EOS tokens before this one
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(is_eos)
    starts[:, 1:] = is_eos[:, :-1]
    starts[:, 0] = True
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return docs, index - first


def attention_mask(docs: torch.Tensor, queries: torch.Tensor | None = None) -> BlockMask | torch.Tensor:
    """Causal attention within each document, for the device `docs` [batch, seq] (the whole rows' document
    indices) is on. queries: the global positions of the rows' queries when they are not all the row's tokens
    (context parallelism: this rank's chunks, against the whole row's keys); None: every position, in order."""
    batch, seq = docs.shape
    if docs.device.type != "cuda":
        if queries is None:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
            return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]
        causal = queries[:, None] >= torch.arange(seq, device=docs.device)[None, :]
        return (causal & (docs[:, queries, None] == docs[:, None, :]))[:, None]

    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return block_mask(docs, queries)


def block_mask(docs: torch.Tensor, queries: torch.Tensor | None = None) -> BlockMask:
    """attention_mask's FlexAttention BlockMask (on any device: tests check it on a CPU, forward only)."""
    if queries is None:
        def same_document(b, h, q, kv):
            return (kv <= q) & (docs[b, q] == docs[b, kv])
    else:
        def same_document(b, h, q, kv):
            position = queries[q]
            return (kv <= position) & (docs[b, position] == docs[b, kv])

    num_queries = docs.shape[1] if queries is None else queries.shape[0]
    return create_block_mask(same_document, docs.shape[0], None, num_queries, docs.shape[1], device=docs.device)


# FlexAttention runs unfused (every score materialized) unless compiled; inside a compiled block dynamo inlines
# this as it would flex_attention itself. Made by attention_mask (eager, before any block runs) with the first
# BlockMask, so importing this module does not import torch.compile.
_compiled_flex: Callable[..., torch.Tensor] | None = None


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: BlockMask | torch.Tensor) -> torch.Tensor:
    """Attention of q [batch, heads, seq, head_dim] over k, v (fewer heads: grouped-query) under `mask`."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
