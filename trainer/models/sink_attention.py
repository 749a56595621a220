"""Attention with a learned sink logit per head and an optional sliding window (GPT-OSS, trainer/models/gpt_oss.py).

A sink is one more logit in each query's softmax, with no value: out = sum_j exp(s_j) v_j / (sum_j exp(s_j) +
exp(sink)). That is plain attention's output times Z / (Z + exp(sink)) = sigmoid(lse - sink), lse = log Z, so a
kernel that returns its logsumexp gives it exactly. A sliding-window layer lets query q see keys q - window < kv <= q
(transformers' `sliding_window_overlay`: `window` keys, itself included); a document mask (data.document_masking,
trainer.models.documents) is combined with it, so a token sees its window within its own document. Under context
parallelism a rank's queries (its two chunks) attend to the whole rows' keys: without documents each chunk against
the keys up to its end (`chunk_sink_attention`), with them under the document mask of the queries at their global
positions, the window taken at those positions too (`positions`).

The two paths, by the mask the device's document masking makes:
- a dense boolean mask, or none on a CPU: the scores materialized ([batch, heads, seq, seq]), the sink a column
  of the softmax, as transformers' eager GptOssAttention computes it (exact, O(seq^2) memory; every CPU run);
- a FlexAttention BlockMask, or none on a GPU: FlexAttention (compiled) with the causal, window and document mask
  as one mask_mod, its logsumexp scaling the output by sigmoid(lse - sink). FlexAttention has no CPU backward:
  on a CPU this path is tested forward only (tests/unit/test_gpt_oss.py), against the dense one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, and_masks, create_block_mask, flex_attention


def dense_window_mask(seq_len: int, window: int, device: torch.device, *, kv_len: int | None = None,
                      q_offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """[seq, kv_len] bool: causal, and within `window` keys of the query where window > 0; query i sits at position
    q_offset + i of the keys (a context-parallel chunk), or at positions[i] where given (a cp rank's two chunks)."""
    q = (torch.arange(seq_len, device=device) + q_offset if positions is None else positions.to(device))[:, None]
    kv = torch.arange(seq_len if kv_len is None else kv_len, device=device)[None, :]
    allowed = kv <= q
    return allowed & (kv > q - window) if window else allowed


def _causal(offset: int) -> Callable:
    def before(b, h, q, kv):
        return kv <= q + offset

    return before


def _sliding(window: int, offset: int = 0) -> Callable:
    def inside(b, h, q, kv):
        return kv > q + offset - window

    return inside


def _sliding_at(window: int, positions: torch.Tensor) -> Callable:
    def inside(b, h, q, kv):
        return kv > positions[q] - window

    return inside


@lru_cache(maxsize=16)
def _plain_block_mask(q_len: int, kv_len: int, q_offset: int, window: int, device: str) -> BlockMask:
    """The causal (and window) BlockMask of one shape: made once, every batch row alike."""
    mod = and_masks(_causal(q_offset), _sliding(window, q_offset)) if window else _causal(q_offset)
    return create_block_mask(mod, None, None, q_len, kv_len, device=device)


def block_mask_for(mask: BlockMask | None, q_len: int, kv_len: int, window: int, device: torch.device, *,
                   q_offset: int = 0, positions: torch.Tensor | None = None) -> BlockMask:
    """The BlockMask of a layer: causal (or a document mask's), and the window; positions: the queries' global
    positions where a document mask is of a cp rank's chunks against the whole rows' keys."""
    if mask is None:
        return _plain_block_mask(q_len, kv_len, q_offset, window, str(device))
    assert q_offset == 0 and (positions is not None or q_len == kv_len), (q_offset, q_len, kv_len)
    if not window:
        return mask
    mod = and_masks(mask.mask_mod, _sliding(window) if positions is None else _sliding_at(window, positions))
    return create_block_mask(mod, mask.kv_num_blocks.shape[0], None, q_len, kv_len, device=device)


# Compiled on the first GPU call (FlexAttention runs unfused unless compiled); a CPU calls flex_attention itself.
_compiled_flex: Callable[..., tuple[torch.Tensor, Any]] | None = None


def _flex(q: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, Any]:
    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention(q, *args, **kwargs)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, *args, **kwargs)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *, window: int,
                   mask: BlockMask | torch.Tensor | None, q_offset: int = 0, positions: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """q [batch, heads, seq, head_dim], k and v [batch, kv_heads, kv_len, head_dim], sinks [heads]; mask: None
    (causal), a dense boolean document mask [batch, 1, seq, kv_len] or a document BlockMask; q_offset: the keys'
    position of the first query (context parallel: kv_len >= q_offset + seq); positions: each query's position
    among the keys instead (context parallel with a document mask, which is causal at those positions already).
    Returns [batch, heads, seq, head_dim] in q's dtype."""
    seq_len, kv_len = q.shape[2], k.shape[2]
    if isinstance(mask, BlockMask) or (mask is None and q.device.type == "cuda"):
        return flex_sink_attention(q, k, v, sinks, block_mask_for(mask, seq_len, kv_len, window, q.device,
                                                                  q_offset=q_offset, positions=positions))
    allowed = dense_window_mask(seq_len, window, q.device, kv_len=kv_len, q_offset=q_offset, positions=positions)
    if mask is not None:
        allowed = allowed & mask
    repeat = q.shape[1] // k.shape[1]  # query head h reads kv head h // repeat, as transformers' repeat_kv
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(q.shape[0], -1, seq_len, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share is dropped
    return probs.to(v.dtype) @ v


def flex_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention under `block_mask`, its output scaled by sigmoid(lse - sink) = Z / (Z + exp(sink))."""
    out, aux = _flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
                     return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(q.dtype)


def chunk_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *, window: int,
                         chunks: tuple[int, int]) -> torch.Tensor:
    """Context parallel: q [batch, heads, 2c, head_dim] holds the sequence's chunks `chunks` (of c queries each), k
    and v the whole sequence's keys in order. Query chunk j attends to keys [0, (j + 1) c) at its global positions,
    each query with its own sink: the chunks are independent softmaxes."""
    c = q.shape[2] // 2
    outs = [sink_attention(q[:, :, half * c:(half + 1) * c], k[:, :, :(j + 1) * c], v[:, :, :(j + 1) * c], sinks,
                           window=window, mask=None, q_offset=j * c) for half, j in enumerate(chunks)]
    return torch.cat(outs, dim=2)
