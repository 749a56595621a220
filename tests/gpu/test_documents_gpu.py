"""Document masking on a GPU (trainer/models/documents.py): the compiled FlexAttention block mask gives each packed
document the per-token losses and gradients it has alone under plain causal SDPA (fp32; the dense-mask CPU path's
own check: tests/unit/test_documents.py), in eager blocks and in torch.compile'd ones, bf16 too; and a row
shorter than FlexAttention's 128-token block."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trainer.models import FLAVORS, build_model
from trainer.models.documents import attention_mask, document_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EOS = 511


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-blocks", "compiled-blocks"])
def test_flex_document_mask_equals_documents_alone(compiled: bool) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(dataclasses.replace(FLAVORS["debug"], max_seq_len=1024))
    model.init_weights(seed=0)
    assert isinstance(attention_mask(torch.zeros(1, 256, dtype=torch.long, device="cuda")),
                      torch.nn.attention.flex_attention.BlockMask)  # the FlexAttention path
    lengths = [[100, 300, 57, 355], [812]]  # 812 tokens: one document
    rows = [torch.cat([torch.cat([torch.randint(0, 500, (n - 1,)), torch.tensor([EOS])]) for n in row]
                      + [torch.randint(0, 500, (1,))]) for row in lengths]
    tokens = torch.stack(rows).cuda()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if compiled:
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block))

    def per_token_loss(x, y) -> torch.Tensor:
        return F.cross_entropy(model.logits(x).flatten(0, 1).float(), y.flatten(), reduction="none").view(y.shape)

    model.set_document_masking(EOS)
    packed = per_token_loss(inputs, labels)
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.document_eos = None  # each document alone: plain causal attention (SDPA) from position 0
    alone = torch.zeros_like(packed)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            span = slice(start, start + n)
            alone[b, span] = per_token_loss(inputs[b:b + 1, span], labels[b:b + 1, span])[0]
            start += n
    alone.sum().backward()
    # fp32 on the GPU: FlexAttention's and SDPA's kernels sum in other orders (TF32 off by default for matmuls).
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    errors = {n: ((packed_grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in model.named_parameters()}
    assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    docs, positions = document_ids(inputs, EOS)
    assert positions[0, 100].item() == 0 and docs[1].max().item() == 0


def test_a_row_shorter_than_one_flex_block_trains() -> None:
    """A 100-token row, bf16, compiled blocks: FlexAttention's blocks are 128 tokens."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(FLAVORS["debug"]).to(torch.bfloat16)
    model.init_weights(seed=0)
    model.set_document_masking(EOS)
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block))
    tokens = torch.randint(0, 500, (2, 101), device="cuda")
    tokens[:, 40] = EOS
    loss = F.cross_entropy(model.logits(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
