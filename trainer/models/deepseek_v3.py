"""DeepSeek-V3: MoE blocks (trainer.models.moe: grouped-GEMM experts, EP, the balancer) with multi-head latent
attention (trainer.models.mla), group-limited sigmoid routing, and multi-token prediction (trainer.models.mtp).

Module names are a contract (FP8 filter, FSDP, EP, checkpoints, the Hugging Face mapping trainer/hf/deepseek_v3.py):

    layers.{i}.attention.*                       MLA (trainer.models.mla)
    layers.{i}.mlp.{gate,up,down}_proj           the first n_dense_layers blocks (first_k_dense_replace)
    layers.{i}.moe.router.gate / .expert_bias    the router; the aux-loss-free bias (e_score_correction_bias)
    layers.{i}.moe.experts.{w1,w2,w3}            routed experts (trainer.models.moe_experts.GroupedExperts)
    layers.{i}.moe.shared_expert.*               n_shared_experts as one MLP
    layers.{n_layers + k}.*                      MTP module k + 1 (trainer.models.mtp.MTPLayer): a block like the last
                                                 one plus enorm, hnorm, eh_proj, shared_head_norm

The MTP modules sit in `layers` after the main blocks, where DeepSeek's checkpoints put them (`model.layers.61`), so
FSDP, activation checkpointing, compile and EP wrap them like any block; `forward` runs the main blocks only and, in
training with MTP, hands the loss (trainer.models.mtp.MTPLossFn) every depth's states.

Routing (`GroupRouter`, transformers' DeepseekV3TopkRouter): sigmoid scores of `router.gate` in fp32; the biased
scores (scores + expert_bias, moved by trainer.models.moe_balancer.MoEBalancer) pick the topk_group groups of the
highest sum of each group's best two, then top_k experts within them; the weights are the unbiased scores of those,
divided by their sum (route_norm = norm_topk_prob), times routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from trainer.model_values import DeepseekV3Args
from trainer.models.counts import layer_param_counts, param_count
from trainer.models.activations import ActivationPolicy, block_activation_bytes
from trainer.models.layers import Decoder, TPPlan, TransformerBlock, prefixed
from trainer.models.mla import MLA, mla_tp_plan
from trainer.models.moe import MoE, MoEBlock, MoETransformer, Router, tp_plan as moe_tp_plan
from trainer.models.mtp import MTPLayer, embeddings_ahead, mtp_forward, mtp_tp_plan, tokens_ahead

# `debug_deepseek_v3` trains on a CPU in seconds (q LoRA, two expert groups, one MTP module); `deepseek_v3_16b` has
# DeepSeek-V2-Lite's shapes (15.7B parameters, 2.4B active; Moonlight-16B-A3B is the same MLA at 64 experts top-6
# too) with DeepSeek-V3's routing: sigmoid scores, the aux-loss-free bias, one MTP module.
FLAVORS: dict[str, DeepseekV3Args] = {
    "debug_deepseek_v3": DeepseekV3Args(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=512, multiple_of=64, rope_theta=10000.0,
        norm_eps=1e-6, n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1, n_dense_layers=1,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, bias_update_rate=1e-3, mtp_layers=1,
    ),
    "deepseek_v3_16b": DeepseekV3Args(
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400, rope_theta=10000.0, max_seq_len=4096,
        norm_eps=1e-6, n_experts=64, top_k=6, moe_ffn_dim=1408, n_shared_experts=2, n_dense_layers=1,
        dense_ffn_dim=10944, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_group=1, topk_group=1, routed_scaling_factor=1.0, bias_update_rate=1e-3, mtp_layers=1,
    ),
}


class GroupRouter(Router):
    """DeepSeek-V3's group-limited top-k (see the module docstring); n_group = 1 is plain top-k."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.n_group, self.topk_group, self.scaling = args.n_group, args.topk_group, args.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (weights [T, k] fp32, expert ids [T, k], scores [T, E] fp32)."""
        logits = self.gate(x).float()  # routing decisions in fp32 whatever the compute dtype
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias.float()
        if self.n_group > 1:
            groups = biased.view(biased.shape[0], self.n_group, -1)
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
            chosen = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
            biased = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(biased)
        idx = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' epsilon
        return weights * self.scaling, idx, scores


class DeepseekV3MoE(MoE):
    """The MoE layer (trainer.models.moe.MoE: its experts, dispatch, stats, aux loss) with the group router."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.router = GroupRouter(args)


class DenseMLABlock(TransformerBlock):
    """One of the first n_dense_layers blocks: MLA and a dense MLP (`layers.{i}.mlp`)."""

    def build_attention(self, args: DeepseekV3Args) -> nn.Module:
        return MLA(args)


class MLABlock(MoEBlock):
    """MLA and the DeepSeek-V3 MoE (`layers.{i}.moe`)."""

    def build_attention(self, args: DeepseekV3Args) -> nn.Module:
        return MLA(args)

    def build_ffn(self, args: DeepseekV3Args) -> nn.Module:
        return DeepseekV3MoE(args)


class MTPMoEBlock(MTPLayer, MLABlock):
    """An MTP module whose block is an MoE one (the last main block is)."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.add_mtp_modules(args)


class MTPDenseBlock(MTPLayer, DenseMLABlock):
    """An MTP module of an all-dense model."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.add_mtp_modules(args)


def _block(args: DeepseekV3Args, i: int) -> nn.Module:
    if i >= args.n_layers:  # an MTP module: a block like the last main one
        return MTPMoEBlock(args) if args.is_moe_layer(args.n_layers - 1) else MTPDenseBlock(args)
    return MLABlock(args) if args.is_moe_layer(i) else DenseMLABlock(args)


class DeepseekV3(MoETransformer):
    """Embeddings, n_layers blocks, then mtp_layers MTP modules in `layers`; the final norm and head shared."""

    def __init__(self, args: DeepseekV3Args):
        if args.rope_scaling is not None:
            raise ValueError("model.rope_scaling: Llama 3's RoPE scaling is not DeepSeek-V3's: set "
                             "model.rope_scaling='none' (its long-context RoPE is YaRN: deepseek_v3.rope_yarn)")
        Decoder.__init__(self, args, [_block(args, i) for i in range(args.n_layers + args.mtp_layers)])
        self.tp_group: dist.ProcessGroup | None = None  # tensor parallel's (set_sequence_group)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the last main block [batch, seq, dim] (of this pipeline stage's blocks); in training
        with MTP modules, every depth's states for trainer.models.mtp.MTPLossFn: [(1 + mtp_layers) x batch, seq,
        dim], the main ones first. documents: as Decoder.forward's; on the last pipeline stage, which holds the MTP
        modules and a copy of the embeddings (trainer.parallel.pipeline), the rows' token ids the ids ahead are
        cut from (`tokens` there are the previous stage's hidden states)."""
        mtp = [layer for name, layer in self.layers.items() if int(name) >= self.args.n_layers]
        depths = len(mtp) if self.training else 0
        if tokens.is_floating_point():  # a later pipeline stage: its input is hidden states, not ids
            h, rope, mask = self.embed(tokens, documents)
            ahead = self.stage_embeddings_ahead(documents, depths, h.shape[1]) if depths else []
        else:
            h, ahead, rope, mask = self.embed_ahead(tokens, depths, documents)
        for name, layer in self.layers.items():
            if int(name) < self.args.n_layers:
                h = layer(h, rope, *mask)
        return mtp_forward(mtp, h, ahead, rope, mask) if ahead else h

    def stage_embeddings_ahead(self, rows: torch.Tensor | None, depths: int, local_len: int) -> list[torch.Tensor]:
        """The last pipeline stage's Emb(t_{i+k}) for each depth, from the rows' token ids (the whole rows under
        context parallelism) and the stage's copy of the embeddings, at this rank's positions; zero past the end."""
        assert rows is not None and not rows.is_floating_point(), (
            "the MTP modules of a pipeline stage need the rows' token ids: Pipeline passes them as `documents`")
        rows = rows.to(self.rope.device)
        local = rows if self.cp is None else self.cp.shard(rows)
        ids, keep = tokens_ahead(local, depths, self.cp, whole=rows)
        ahead = self.lookup(ids[local.shape[0]:])  # the tokens' own rows are the previous stage's
        if self.tp_group is not None:  # this rank's sequence shard of the whole sequences' masks
            start = dist.get_rank(self.tp_group) * local_len
            keep = [k[start:start + local_len] for k in keep]
        return [e * k for e, k in zip(ahead.chunk(depths, dim=0), keep)]

    def embed_ahead(self, tokens: torch.Tensor, depths: int, documents: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, tuple]:
        """Decoder.embed's (embeddings, rope, mask) and each MTP depth's Emb(t_{i+k}), from one call of the
        embeddings (their FSDP2 unit runs once per step): shifted whole sequences, or under context and tensor
        parallelism, where t_{i+k} may sit on another rank, the ids ahead looked up with the tokens
        (trainer.models.mtp.tokens_ahead; tp: each rank keeps its sequence shard of the past-the-end masks)."""
        if not depths or (self.cp is None and self.tp_group is None):
            emb, rope, mask = self.embed(tokens, documents)
            return emb, embeddings_ahead(emb, depths), rope, mask
        ids, keep = tokens_ahead(tokens, depths, self.cp, whole=documents)
        # The ids ahead ride in the tokens' lookup; RoPE rows and the document mask are the tokens' own, from the
        # whole rows (`documents`, or `tokens` where they are whole), not from the stacked ids.
        rows, rope, mask = self.embed(ids, tokens if documents is None else documents)
        emb, *ahead = rows.chunk(1 + depths, dim=0)
        if self.tp_group is not None:  # this rank's sequence shard of the whole sequences' masks
            start = dist.get_rank(self.tp_group) * emb.shape[1]
            keep = [k[start:start + emb.shape[1]] for k in keep]
        return emb, [e * k for e, k in zip(ahead, keep)], rope, mask

    def set_sequence_group(self, group: dist.ProcessGroup) -> None:
        """Tensor parallel (trainer.models.deepseek_v3.tp_plan's sequence_modules): the tp group, whose ranks hold
        the other shards of each sequence, which the MTP modules' embeddings ahead are cut from."""
        self.tp_group = group


def tp_plan(model: DeepseekV3, *, loss_parallel: bool) -> TPPlan:
    """The MoE family's plan (trainer.models.moe.tp_plan: dense MLPs and shared experts tensor-parallel, routed
    experts whole on each tp rank's sequence slice) with MLA's attention (trainer.models.mla.mla_tp_plan) in place
    of q/k/v; an MTP module's own norms and eh_proj on each rank's sequence shard (trainer.models.mtp.mtp_tp_plan)."""
    plan = moe_tp_plan(model, loss_parallel=loss_parallel)
    for name, block in model.layers.items():
        gqa = {f"attention.{n}" for n in ("q_proj", "k_proj", "v_proj")}
        plan.blocks[name] = ({fqn: style for fqn, style in plan.blocks[name].items() if fqn not in gqa}
                             | prefixed("attention", mla_tp_plan(block.attention))
                             | (mtp_tp_plan() if isinstance(block, MTPLayer) else {}))
    if model.args.mtp_layers:  # the embeddings ahead are cut from whole sequences, then sharded: the model needs tp's
        plan.sequence_modules.append(model)
    plan.summary = ("; MLA: q_b_proj/kv_b_proj column-parallel over heads, q_a_proj/kv_a_proj_with_mqa and their norms "
                    "replicated" + plan.summary)
    return plan


# ---------------------------------------------------------------------------
# Counting


def describe(args: DeepseekV3Args) -> str:
    """The startup line after `Model:`: MLA, routing, MTP."""
    q = f"q_lora_rank={args.q_lora_rank}" if args.q_lora_rank else "plain q_proj"
    return (
        "DeepSeek-V3: %s active parameters per token (MFU counts these); MLA (%s, kv_lora_rank=%d, qk heads %d+%d, "
        "v heads %d); %d routed experts top-%d in %d of %d groups (%s scores%s, x%g), %d shared, %d dense layers; "
        "bias_update_rate=%g, aux_loss_coef=%g; %s; %s" % (
            f"{param_counts(args)[1]:,}", q, args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim,
            args.v_head_dim, args.n_experts, args.top_k, args.topk_group, args.n_group, args.score_func,
            ", renormalized" if args.route_norm else "", args.routed_scaling_factor, args.n_shared_experts,
            args.n_dense_layers, args.bias_update_rate, args.aux_loss_coef,
            f"{args.mtp_layers} MTP modules, loss weight {args.mtp_loss_weight:g}" if args.mtp_layers else "no MTP",
            "plain RoPE" if (y := args.rope_yarn) is None else
            f"YaRN RoPE x{y.factor:g} from {y.original_max_seq_len} (cos/sin x{y.attention_factor:.4g}, softmax "
            f"scale x{y.softmax_factor:.4g})",
        )
    )


def param_counts(args: DeepseekV3Args) -> tuple[int, int]:
    """(total, active) parameters, MTP modules included (they train with the model). Active: without the embedding
    table and the routed experts a token does not choose, in the main MoE blocks and the MTP ones."""
    n_moe = args.n_layers - min(args.n_dense_layers, args.n_layers)
    n_moe += args.mtp_layers if n_moe else 0
    total = param_count(args) - n_moe * args.n_experts  # param_count also counts the expert-bias buffers
    unchosen = n_moe * (args.n_experts - args.top_k) * 3 * args.dim * args.moe_ffn_dim
    return total, total - args.vocab_size * args.dim - unchosen


def block_runs(args: DeepseekV3Args) -> tuple[range, ...]:
    """The dense blocks, the MoE blocks, the MTP modules (each run that has any)."""
    n_dense = min(args.n_dense_layers, args.n_layers)
    runs = (range(n_dense), range(n_dense, args.n_layers), range(args.n_layers, args.n_layers + args.mtp_layers))
    return tuple(r for r in runs if r)


def block_params(args: DeepseekV3Args, i: int) -> tuple[int, int]:
    """(parameters of block i, of which routed experts' and their router's); an MTP module is its block plus its
    two norms, eh_proj and its head norm."""
    attention, dense, shared, routed = layer_param_counts(args)
    extra = 3 * args.dim + 2 * args.dim * args.dim if i >= args.n_layers else 0
    j = min(i, args.n_layers - 1)
    return (attention + shared + routed + extra, routed) if args.is_moe_layer(j) else (attention + dense + extra, 0)


def _sdpa_args(args: DeepseekV3Args) -> DeepseekV3Args:
    """MLA's SDPA as the shared activation count sees attention: n_heads query, key and value heads of the padded
    width max(qk_head_dim, v_head_dim)."""
    return replace(args, n_kv_heads=args.n_heads, qk_nope_head_dim=0,
                   qk_rope_head_dim=max(args.qk_head_dim, args.v_head_dim))


def activation_bytes(args: DeepseekV3Args, i: int, policy: ActivationPolicy) -> tuple[int, int]:
    """(saved, backward) bytes per token of block i: the shared count over MLA's SDPA shapes (`_sdpa_args`: its
    head_dim property is then the padded head), plus the latents MLA saves (q's and kv's low-rank outputs and their
    norms' inputs, the shared RoPE key) unless the block is fully checkpointed; an MTP module adds its concatenation."""
    j = min(i, args.n_layers - 1)
    sdpa = _sdpa_args(args)
    if args.is_moe_layer(j):
        saved, backward = block_activation_bytes(sdpa, policy, ffn_dim=args.n_shared_experts * args.moe_ffn_dim,
                                                 fp8_mlp=False, routed_rows=args.top_k, routed_dim=args.moe_ffn_dim)
    else:
        saved, backward = block_activation_bytes(sdpa, policy, ffn_dim=args.ffn_dim, fp8_mlp=policy.fp8_mlp)
    latents = 2 * (args.q_lora_rank + args.kv_lora_rank + args.qk_rope_head_dim) * policy.compute_bytes
    latents += (4 * args.dim if i >= args.n_layers else 0) * policy.compute_bytes  # [enorm(e); hnorm(h)], h'
    if policy.ac == "full":
        return saved, backward + latents
    return saved + latents, backward


def flops_per_token(args: DeepseekV3Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the active parameters (MTP modules and their head included) + attention
    (QK^T over qk_head_dim and AV over v_head_dim, forward and backward, no causal halving) per block."""
    _, active = param_counts(args)
    heads = args.n_heads * (args.qk_head_dim + args.v_head_dim)
    head = args.mtp_layers * args.dim * args.vocab_size  # each MTP depth runs the output head again
    return 6 * (active + head) + 6 * (args.n_layers + args.mtp_layers) * heads * seq_len
