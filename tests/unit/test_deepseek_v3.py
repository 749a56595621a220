"""DeepSeek-V3 (trainer/models/deepseek_v3.py, mla.py, mtp.py) against independent references: MLA against attention
written out in float64 (scores, causal mask, softmax), the group-limited router against a per-token loop, the
closed-form counts against the built model, and the MTP targets and loss against their definitions."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from trainer.loss import IGNORE_INDEX
from trainer.model_values import DeepseekV3Args, values_problem
from trainer.models.counts import num_params_for, num_tensors, param_count
from trainer.models import build_model, family_of, flops_per_token, param_counts
from trainer.models.deepseek_v3 import FLAVORS, DeepseekV3, GroupRouter
from trainer.models.documents import attention_mask, document_ids
from trainer.models.layers import apply_rope, rope_cache
from trainer.models.mla import MLA
from trainer.models.mtp import MTPLossFn, mtp_labels

DEBUG = FLAVORS["debug_deepseek_v3"]


def _model(args: DeepseekV3Args, *, seed: int = 0) -> DeepseekV3:
    with torch.device("meta"):
        model = DeepseekV3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def _reference_mla(mla: MLA, x: torch.Tensor, rope: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """MLA in float64, written out: per head q = [nope | rope(q_rot)], k = [nope | rope(shared k_rot)], scores
    scaled by 1/sqrt(qk_head_dim), `allowed` [batch, seq, seq] masking, softmax, then v and o_proj."""
    m = {n: p.double() for n, p in mla.named_parameters()}
    x = x.double()
    b, s, _ = x.shape
    if mla.q_lora_rank:
        q_a = x @ m["q_a_proj.weight"].T
        q_a = q_a * torch.rsqrt(q_a.pow(2).mean(-1, keepdim=True) + 1e-6) * m["q_a_layernorm.weight"]
        q = q_a @ m["q_b_proj.weight"].T
    else:
        q = x @ m["q_proj.weight"].T
    q = q.view(b, s, -1, mla.qk_dim).transpose(1, 2)
    kv_a = x @ m["kv_a_proj_with_mqa.weight"].T
    latent, k_rot = kv_a[..., :mla.kv_lora_rank], kv_a[..., mla.kv_lora_rank:]
    latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + 1e-6) * m["kv_a_layernorm.weight"]
    kv = (latent @ m["kv_b_proj.weight"].T).view(b, s, -1, mla.nope + mla.v_dim).transpose(1, 2)
    k_nope, v = kv[..., :mla.nope], kv[..., mla.nope:]
    rope = (rope[:s] if rope.dim() == 3 else rope).double()  # per row: each token's own position
    q_rot, k_rot = apply_rope(q[..., mla.nope:], rope), apply_rope(k_rot.unsqueeze(1), rope)
    q = torch.cat([q[..., :mla.nope], q_rot], -1)
    k = torch.cat([k_nope, k_rot.expand_as(q_rot)], -1)
    scores = (q @ k.transpose(-1, -2)) / mla.qk_dim**0.5
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, s, -1) @ m["o_proj.weight"].T


@pytest.mark.parametrize("changes", [dict(), dict(q_lora_rank=0, v_head_dim=64), dict(v_head_dim=16)],
                         ids=["q lora, v = nope", "plain q, v wider than qk", "v narrower than qk"])
def test_mla_matches_attention_written_out_causal_and_document_masked(changes):
    args = replace(DEBUG, **changes)
    torch.manual_seed(0)
    mla = MLA(args)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.1) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    x = torch.randn(2, 12, args.dim)
    rope = rope_cache(args, 32)
    causal = torch.ones(12, 12, dtype=torch.bool).tril().expand(2, 12, 12)
    with torch.no_grad():
        assert torch.allclose(mla(x, rope).double(), _reference_mla(mla, x, rope, causal), rtol=1e-4, atol=1e-5)
    # Document masking: attention within each document, RoPE positions restarting at each (the blocks' mask path).
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 9, 9]])
    docs, positions = document_ids(tokens, 0)
    allowed = causal & (docs.unsqueeze(2) == docs.unsqueeze(1))
    with torch.no_grad():
        ours = mla(x, rope[positions], attention_mask(docs))
        for row in range(2):  # each document alone, positions from 0: the same outputs
            for doc in docs[row].unique():
                idx = (docs[row] == doc).nonzero().flatten()
                alone = mla(x[row:row + 1, idx], rope)
                assert torch.allclose(ours[row, idx], alone[0], rtol=1e-4, atol=1e-5)
        assert torch.allclose(ours.double(), _reference_mla(mla, x, rope[positions], allowed), rtol=1e-4, atol=1e-5)


def _reference_route(router: GroupRouter, x: torch.Tensor) -> tuple[list[set[int]], torch.Tensor]:
    """Per token, in Python: groups by the sum of their two best biased scores, then top_k within the chosen groups;
    weights = the unbiased scores, renormalized, times the scaling factor."""
    scores = router.gate(x).double().sigmoid()
    biased = scores + router.expert_bias.double()
    per = router.n_experts // router.n_group
    chosen, weights = [], []
    for t in range(x.shape[0]):
        group_score = [sorted(biased[t, g * per:(g + 1) * per].tolist())[-2:] for g in range(router.n_group)]
        groups = sorted(range(router.n_group), key=lambda g: -sum(group_score[g]))[:router.topk_group]
        allowed = [e for e in range(router.n_experts) if e // per in groups]
        experts = sorted(allowed, key=lambda e: -biased[t, e].item())[:router.top_k]
        w = scores[t, experts]
        weights.append(sorted((w / w.sum() * router.scaling).tolist()))
        chosen.append(set(experts))
    return chosen, torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("n_group, topk_group, top_k", [(4, 2, 3), (2, 1, 2), (1, 1, 2)])
def test_group_router_matches_a_per_token_reference(n_group, topk_group, top_k):
    args = replace(DEBUG, n_experts=8, n_group=n_group, topk_group=topk_group, top_k=top_k)
    torch.manual_seed(1)
    router = GroupRouter(args)
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    router.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(64, args.dim)
    with torch.no_grad():
        weights, idx, _ = router(x)
    chosen, ref_weights = _reference_route(router, x)
    assert [set(row.tolist()) for row in idx] == chosen
    assert torch.allclose(weights.sort(-1).values.double(), ref_weights, rtol=1e-5)
    if n_group > 1:  # group-limited: every token's experts lie in at most topk_group groups
        assert all(len({e // (8 // n_group) for e in row}) <= topk_group for row in chosen)


@pytest.mark.parametrize("flavor", list(FLAVORS))
@pytest.mark.parametrize("mtp_layers", [0, 2])
def test_closed_form_counts_match_the_built_model(flavor, mtp_layers):
    args = replace(FLAVORS[flavor], n_layers=3, mtp_layers=mtp_layers)
    with torch.device("meta"):
        model = build_model(args)
    assert family_of(args).name == "deepseek_v3" and isinstance(model, DeepseekV3)
    params = sum(p.numel() for p in model.parameters())
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
    assert param_count(args) == params + biases
    assert num_params_for(args)[0] == params and num_tensors(args) == len(model.state_dict())
    total, active = param_counts(args)
    assert total == params
    unchosen = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n) * (
        1 - args.top_k / args.n_experts)
    assert active == params - args.vocab_size * args.dim - unchosen
    assert len(model.layers) == 3 + mtp_layers


def test_the_16b_flavor_has_deepseek_v2_lites_size_and_flops():
    args = replace(FLAVORS["deepseek_v3_16b"], mtp_layers=0)
    total, active = param_counts(args)
    assert round(total / 1e9, 1) == 15.7 and 2.4e9 <= active < 2.5e9  # DeepSeek-V2-Lite: 15.7B, 2.4B active
    attention = 6 * 27 * 16 * (192 + 128) * 4096  # QK^T over 192 wide heads, AV over 128, forward and backward
    assert flops_per_token(args, 4096) == 6 * active + attention
    with_mtp = FLAVORS["deepseek_v3_16b"]  # one MTP module: its block, eh_proj and the head again
    assert flops_per_token(with_mtp, 4096) > flops_per_token(args, 4096) + 6 * args.vocab_size * args.dim


@pytest.mark.parametrize("changes, message", [
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim=15 must be even"),
    (dict(n_group=3), "n_experts=8 must be a multiple of n_group=3"),
    (dict(n_group=8), "with at least 2 experts per group"),
    (dict(topk_group=3), "topk_group=3 must be at most n_group=2"),
    (dict(n_group=4, topk_group=1, top_k=3), "top_k=3 must be at most the experts of topk_group=1 groups"),
])
def test_bad_mla_and_routing_values_are_named(changes, message):
    args = replace(DEBUG, **changes)
    values = {f: getattr(args, f) for f in args.__dataclass_fields__ if f != "rope_scaling"}
    assert message in values_problem(values)


def test_mtp_targets_shift_by_depth_and_stop_at_the_end_and_at_ignored_labels():
    labels = torch.tensor([[1, 2, 3, IGNORE_INDEX, 5, 6, 7, 8]])
    assert mtp_labels(labels, 1).tolist() == [[2, 3, -100, -100, 6, 7, 8, -100]]
    # Depth 2: position i's target is labels[i + 2]; none across the ignored label (a document end).
    assert mtp_labels(labels, 2).tolist() == [[3, -100, -100, -100, 7, 8, -100, -100]]


def test_mtp_forward_and_loss_match_their_definition():
    args = replace(DEBUG, mtp_layers=2, n_layers=2, mtp_loss_weight=0.3)
    model = _model(args).train()
    tokens = torch.randint(0, args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    labels[0, 4] = IGNORE_INDEX
    h = model(tokens)
    assert h.shape == (3 * 2, 10, args.dim)
    # Depth 1 by hand: eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]), the block, its head norm.
    main = h[:2]
    mtp1 = model.layers["2"]
    emb = model.tok_embeddings(tokens)
    shifted = torch.cat([emb[:, 1:], torch.zeros_like(emb[:, :1])], 1)
    x = mtp1.eh_proj(torch.cat([mtp1.enorm(shifted), mtp1.hnorm(main)], -1))
    block = x + mtp1.attention(mtp1.attention_norm(x), model.rope)
    block = block + mtp1.moe(mtp1.mlp_norm(block))
    assert torch.allclose(h[2:4], mtp1.shared_head_norm(block), atol=1e-5)
    loss_fn = MTPLossFn(model.norm, model.output_head, depths=2, weight=0.3)
    total = loss_fn.sum(h, labels)

    def ce(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)

    head = model.output_head
    depth = [ce(head(h[2 * k:2 * k + 2]), mtp_labels(labels, k)) for k in (1, 2)]
    expected = ce(head(model.norm(main)), labels) + 0.3 / 2 * (depth[0] + depth[1])
    assert torch.allclose(total, expected, rtol=1e-5)
    metrics = loss_fn.pop_metrics()
    counts = [(mtp_labels(labels, k) != IGNORE_INDEX).sum().item() for k in (1, 2)]
    assert metrics == pytest.approx({f"mtp_loss_{k}": depth[k - 1].item() / counts[k - 1] for k in (1, 2)})
    assert loss_fn.pop_metrics() == {}  # reset
    total.backward()  # every MTP weight trains; the embeddings and head get the MTP terms' gradients too
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if n.startswith(("layers.2.", "layers.3.")) and ".experts." not in n and "router" not in n)
    # Evaluation: the main states only, and the LM loss alone.
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(tokens), main, atol=1e-6)
        assert torch.allclose(loss_fn.sum(model(tokens), labels), ce(head(model.norm(main)), labels), rtol=1e-5)


def test_llama3_rope_scaling_is_refused_in_one_line():
    from trainer.model_values import RopeScaling

    with pytest.raises(ValueError, match="model.rope_scaling: Llama 3's RoPE scaling is not DeepSeek-V3's"):
        DeepseekV3(replace(DEBUG, rope_scaling=RopeScaling()))


def test_the_pipeline_split_costs_sum_to_the_flops_per_token():
    from trainer.models import pipeline_costs

    for name in FLAVORS:  # the MTP modules count with the head: the last pipeline stage runs them
        for args in (FLAVORS[name], replace(FLAVORS[name], mtp_layers=0), replace(FLAVORS[name], mtp_layers=2)):
            embedding, blocks, head = pipeline_costs(args, 256)
            assert embedding + sum(blocks) + head == pytest.approx(flops_per_token(args, 256), rel=1e-12), name
            assert blocks[0] != blocks[-1]  # a dense block and an MoE block cost apart
            assert len(blocks) == args.n_layers
        assert head > pipeline_costs(replace(FLAVORS[name], mtp_layers=0), 256)[2]


def test_the_attention_backends_reach_mla():
    from torch.nn.attention import SDPBackend

    from trainer.parallel.apply import apply_attention_backends

    model = _model(replace(DEBUG, n_layers=2))
    apply_attention_backends(model, ("MATH",))
    mla = [m for m in model.modules() if isinstance(m, MLA)]
    assert len(mla) == 3 and all(m.sdpa_backends == [SDPBackend.MATH] for m in mla)  # the MTP module's too


def test_the_chunked_mtp_loss_equals_the_whole_one():
    args = replace(DEBUG, mtp_layers=2, n_layers=2)
    model = _model(args).train()
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    h = model(tokens)
    whole = MTPLossFn(model.norm, model.output_head, depths=2, weight=0.3)
    chunked = MTPLossFn(model.norm, model.output_head, depths=2, weight=0.3, chunk_tokens=7)
    a, b = whole.sum(h, labels), chunked.sum(h, labels)
    assert torch.allclose(a, b, rtol=1e-5)
    assert whole.pop_metrics() == pytest.approx(chunked.pop_metrics(), rel=1e-5)
    (ga,) = torch.autograd.grad(a, model.layers["3"].eh_proj.weight, retain_graph=True)
    (gb,) = torch.autograd.grad(b, model.layers["3"].eh_proj.weight)
    assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-7)
