"""GPT-OSS's own pieces (trainer/models/gpt_oss.py, sink_attention.py) against plain references: the sink attention's
two paths, document masking with the window, the biased clamped experts on the grouped GEMM against a per-expert loop
in float64. Parity with transformers: tests/unit/test_hf_gpt_oss.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from trainer.models import build_model
from trainer.models.documents import attention_mask, document_ids
from trainer.models.gpt_oss import FLAVORS, ClampedSwiGLU, GptOssExperts
from trainer.models.sink_attention import dense_window_mask, sink_attention


def _reference(q, k, v, sinks, allowed):
    """Per query: softmax over its allowed keys and the sink, in float64, the sink's share dropped."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = (q.double() @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.double().exp().view(1, -1, 1, 1))
    return (weights @ v).float()


def _qkv(seq=40, heads=4, kv=2, dim=16):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, seq, dim, generator=gen), torch.randn(2, kv, seq, dim, generator=gen),
            torch.randn(2, kv, seq, dim, generator=gen), torch.randn(heads, generator=gen))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sink_attention_dense_and_flex_paths_equal_the_reference():
    q, k, v, sinks = _qkv()
    for window in (0, 8):
        allowed = dense_window_mask(40, window, q.device)
        expected = _reference(q, k, v, sinks, allowed)
        assert torch.allclose(sink_attention(q, k, v, sinks, window=window, mask=None), expected, atol=1e-5)
        # The GPU's path (FlexAttention and its logsumexp), forward on a CPU: a BlockMask of documents.
        docs = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
        dense = attention_mask(docs)  # a CPU's document mask: dense boolean
        same_doc = create_block_mask(lambda b, h, qi, kvi: (kvi <= qi) & (docs[b, qi] == docs[b, kvi]), 2, None, 40,
                                     40, device="cpu")
        expected = _reference(q, k, v, sinks, allowed & dense)
        assert torch.allclose(sink_attention(q, k, v, sinks, window=window, mask=dense), expected, atol=1e-5)
        assert torch.allclose(sink_attention(q, k, v, sinks, window=window, mask=same_doc), expected, atol=1e-5)


def test_document_masking_composes_with_the_window():
    """A packed row of two documents gives each document's logits as if it were alone (window and all)."""
    args = replace(FLAVORS["debug_gpt_oss"], n_layers=2, sliding_window=6, max_seq_len=64)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the sinks and biases random: the pretraining init leaves the biases 0
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias", "b13", "b2")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    eos = 1
    first, second = torch.randint(2, 512, (1, 20), generator=gen), torch.randint(2, 512, (1, 14), generator=gen)
    first[0, -1] = eos
    model.eval()
    with torch.no_grad():
        alone = torch.cat([model.logits(first), model.logits(second)], dim=1)
        model.set_document_masking(eos)
        packed = model.logits(torch.cat([first, second], dim=1))
    assert document_ids(torch.cat([first, second], dim=1), eos)[1][0, 20] == 0
    assert torch.allclose(packed, alone, atol=1e-5)


def test_biased_clamped_experts_match_a_per_expert_loop_with_gradients():
    torch.manual_seed(0)
    dim, hidden, n_experts, k = 8, 6, 4, 2
    experts = GptOssExperts(dim, hidden, n_experts, glu=ClampedSwiGLU(alpha=1.702, limit=1.0)).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 1.0)  # large enough that the clamp binds
    x = torch.randn(10, dim, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, n_experts, (10, k))
    experts_flat = idx.reshape(-1)
    order = torch.argsort(experts_flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(experts_flat, minlength=n_experts)
    out = experts(x, counts, order, inverse, k)
    ref = []
    for a in order.tolist():
        e, row = experts_flat[a], x[a // k]
        gate_up = experts.w13[e] @ row + experts.b13[e]
        gate, up = gate_up[:hidden].clamp(max=1.0), gate_up[hidden:].clamp(-1.0, 1.0)
        ref.append(experts.w2[e] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + experts.b2[e])
    ref = torch.stack(ref)
    assert torch.allclose(out, ref, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), [x, *experts.parameters()])
    expected = torch.autograd.grad(ref.square().sum(), [x, *experts.parameters()])
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(grads, expected))
