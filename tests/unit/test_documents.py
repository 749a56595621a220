"""Document masking (trainer/models/documents.py, data.document_masking): a packed row attends within each document
and restarts RoPE at each, so it gives the same per-token losses and gradients as its documents run one at a time
(fp32). The layouts that compose: tests/distributed/test_documents.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from trainer.config import ConfigError, load_job_config
from trainer.models import FLAVORS, build_model
from trainer.models.documents import attention_mask, block_mask, document_ids

EOS = 511


def test_document_ids_and_positions() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 1, 2, 3, 4, 5, 6]])
    docs, positions = document_ids(tokens, EOS)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def _model(qk_norm: bool = False) -> torch.nn.Module:
    args = dataclasses.replace(FLAVORS["debug"], qk_norm=qk_norm)
    model = build_model(args)
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("flavor", ["debug", "debug-qk_norm", "debug_moe"])
def test_a_packed_row_equals_its_documents_one_at_a_time(flavor: str) -> None:
    """Two rows packing 3 and 4 documents (each ended by EOS) of 3-9 tokens: every token's loss and the summed loss's
    gradient of every parameter equal those of each document run alone, from position 0 (fp32: sums in another
    order, 1e-5 relative). Without the mask the losses differ (checked), so the comparison has teeth."""
    torch.manual_seed(0)
    if flavor == "debug_moe":
        # No load-balancing loss: it is a statistic of each whole row, not a sum over its tokens.
        model = build_model(dataclasses.replace(FLAVORS["debug_moe"], capacity_factor=0.0, aux_loss_coef=0.0))
        model.init_weights(seed=0)
    else:
        model = _model(qk_norm=flavor.endswith("qk_norm"))
    lengths = [[4, 9, 6], [3, 5, 7, 4]]
    rows = []
    for row in lengths:
        docs = [torch.cat([torch.randint(0, 500, (n - 1,)), torch.tensor([EOS])]) for n in row]
        rows.append(torch.cat(docs + [torch.randint(0, 500, (1,))]))  # one more token: the last label
    width = min(len(r) for r in rows)
    tokens = torch.stack([r[:width] for r in rows])
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def per_token_loss(m, x, y) -> torch.Tensor:
        return F.cross_entropy(m.logits(x).flatten(0, 1).float(), y.flatten(), reduction="none").view(y.shape)

    plain = per_token_loss(model, inputs, labels)
    model.set_document_masking(EOS)
    model.zero_grad()
    packed = per_token_loss(model, inputs, labels)
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.document_eos = None  # each document alone: plain causal attention from position 0, no mask
    alone = torch.zeros_like(packed)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            end = min(start + n, inputs.shape[1])
            if start >= end:
                break
            # The document alone in a row of its own: positions from 0, nothing before it to attend to.
            alone[b, start:end] = per_token_loss(model, inputs[b:b + 1, start:end], labels[b:b + 1, start:end])[0]
            start = end
    alone.sum().backward()
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    errors = {name: ((packed_grads[name] - p.grad).norm() / p.grad.norm()).item()
              for name, p in model.named_parameters()}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]  # measured: < 1e-6
    assert (plain - packed).abs().max() > 1e-2  # the documents after the first see other documents without the mask


def test_a_mask_of_some_queries_is_those_rows_of_the_whole_mask() -> None:
    """Context parallelism's mask: this rank's queries (chunks 1 and 2 of 4 here) against the whole row's keys are
    the rows of the whole row's mask at their global positions."""
    tokens = torch.tensor([[5, EOS, 6, 7, 8, EOS, 9, 1], [1, 2, 3, 4, 5, 6, EOS, 7]])
    docs, _ = document_ids(tokens, EOS)
    queries = torch.tensor([2, 3, 4, 5])
    assert torch.equal(attention_mask(docs, queries), attention_mask(docs)[:, :, queries])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("queries", [None, [16, 17, 18, 19, 20, 21, 22, 23, 40, 41, 42, 43, 44, 45, 46, 47]],
                         ids=["whole-row", "cp-chunks"])
def test_the_gpu_block_mask_attends_as_the_dense_mask(queries: list[int] | None) -> None:
    """The FlexAttention BlockMask a GPU run takes (here on a CPU, forward only, uncompiled) gives the dense mask's
    attention, for a whole row's queries and for a cp rank's chunks (1 and 6 of 8) against the whole row's keys."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 8, (2, 64))
    tokens[tokens == 7] = EOS  # documents of a few tokens
    docs, _ = document_ids(tokens, EOS)
    q_positions = None if queries is None else torch.tensor(queries)
    q = torch.randn(2, 4, 64 if queries is None else len(queries), 16)
    k, v = torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(docs, q_positions), enable_gqa=True)
    flex = flex_attention(q, k, v, block_mask=block_mask(docs, q_positions), enable_gqa=True)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)


def test_document_masking_needs_documents() -> None:
    with pytest.raises(ConfigError, match=r"^data.document_masking=true needs documents"):
        load_job_config(["--data.source=synthetic", "--data.document_masking=true"])
    for layout in ("--distributed.pp=2", "--distributed.cp=2"):  # every layout takes it
        assert load_job_config(["--data.document_masking=true", layout]).data.document_masking
