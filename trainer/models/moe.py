"""Mixture-of-experts decoder: token-choice top-k routing, grouped-GEMM experts, shared experts.

A block is attention (shared with the dense Llama, `trainer.models.layers`) plus an MoE
feed-forward. Module names are a contract (FP8 filter, FSDP, EP, checkpoints, tests):

    layers.{i}.moe.router.gate                  Linear dim -> n_experts (the router)
    layers.{i}.moe.router.expert_bias           buffer [n_experts]: aux-loss-free balancing bias
    layers.{i}.moe.experts.{w1,w2,w3}           3-D parameters [n_experts, ...] (SwiGLU gate, down, up)
    layers.{i}.moe.shared_expert.{gate,up,down}_proj   the shared expert(s) as one dense MLP

The other blocks are dense Llama blocks (`layers.{i}.mlp.*`, dense_ffn_dim wide): the first `n_dense_layers`, those
between every `sparse_step`-th and those `dense_layers` lists (`MoEArgs.is_moe_layer`, Qwen3-MoE's rule).

Routed experts (`trainer.models.moe_experts.GroupedExperts`) run as one grouped GEMM over
tokens sorted by expert, as dispatch -> kernel -> combine: expert parallelism
(`trainer.parallel.expert_parallel.apply_ep`) installs a dispatcher that moves the sorted tokens
to the ranks holding their experts and back, FP8 experts (float8.moe_experts) a kernel.

Load balancing, both kinds users expect:
- an auxiliary loss (`aux_loss_coef`), computed per sequence (DeepSeek-V3's
  sequence-wise balance loss), so it is the same whatever the data-parallel split.
  Each MoE layer injects its gradient through autograd (`attach_aux_loss`, Megatron's
  `MoEAuxLossAutoScaler`): the layer's output passes through unchanged and backward adds
  the aux loss's gradient, scaled like the LM loss (`aux_grad_scale`, set by the step to
  loss scale / microbatches). So no layer returns its aux loss, a pipeline stage needs no
  side channel for it, and every layout uses the one mechanism;
- the auxiliary-loss-free bias (`bias_update_rate`, DeepSeek-V3): a per-expert bias
  added to the scores for the top-k choice only, moved after every optimizer step
  by `rate * sign(mean load - load)`, minus the mean of that step, from the step's token
  counts summed over all data-parallel ranks (`MoEBalancer`). Subtracting the mean keeps
  the biases summing to zero (the peer trainer does it; the DeepSeek-V3 paper states no
  mean subtraction), so they cannot drift together; a skipped optimizer step moves none.
Token dropping is off by default (`capacity_factor = 0`); with a capacity factor c,
each expert keeps at most ceil(c * seq_len * top_k / n_experts) tokens of each
sequence (the earliest positions), again independent of the layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from trainer.distributed import all_reduce_sum_identity_backward
from trainer.model_values import MoEArgs, RopeScaling
from trainer.models.counts import layer_param_counts, param_count
from trainer.models.activations import ActivationPolicy, block_activation_bytes
from trainer.models.layers import (MLP, Decoder, TPPlan, TransformerBlock, block_tp_plan, decoder_tp_plan, mlp_tp_plan,
                                   prefixed)
from trainer.models.moe_experts import GROUP_ALIGN, GroupedExperts, grouped_swiglu  # noqa: F401 (re-exported)
from trainer.models.moe_permute import experts_to_tokens, inverse_permutation


# `debug_moe` trains on a CPU in seconds; `moe_small` fits one GPU; `moe_16b` has
# DeepSeek-MoE-16B shapes (GQA attention instead of MHA) and fits 4x H200 with ep=4. The Qwen3-MoE ones
# (Qwen3MoeForCausalLM: q/k norms, softmax top-k renormalized, no shared experts, no expert bias): `qwen3_moe_debug`
# on a CPU in seconds (every other block MoE, head_dim apart from dim / n_heads), `qwen3_30b_a3b` the published
# Qwen3-30B-A3B's shapes (30.5B parameters; 3.3B active with the embeddings, as Qwen counts, 3.0B without).
MOE_FLAVORS: dict[str, MoEArgs] = {
    "debug_moe": MoEArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, rope_theta=10000.0,
        n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1, n_dense_layers=1,
        aux_loss_coef=0.01, bias_update_rate=1e-3,
    ),
    "moe_small": MoEArgs(
        dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0), n_experts=32, top_k=4, moe_ffn_dim=512, n_shared_experts=1,
        n_dense_layers=1, dense_ffn_dim=4096, aux_loss_coef=1e-3, bias_update_rate=1e-3,
    ),
    "moe_16b": MoEArgs(
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=8, vocab_size=102400, rope_theta=10000.0, max_seq_len=4096,
        n_experts=64, top_k=6, moe_ffn_dim=1408, n_shared_experts=2, n_dense_layers=1, dense_ffn_dim=10944,
        aux_loss_coef=1e-3, bias_update_rate=1e-3,
    ),
    "qwen3_moe_debug": MoEArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, explicit_head_dim=48, vocab_size=512, norm_eps=1e-6,
        rope_theta=1000000.0, qk_norm=True, n_experts=8, top_k=2, moe_ffn_dim=64, dense_ffn_dim=192, sparse_step=2,
        route_norm=True, aux_loss_coef=0.01,
    ),
    "qwen3_30b_a3b": MoEArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, explicit_head_dim=128, vocab_size=151936, norm_eps=1e-6,
        rope_theta=1000000.0, max_seq_len=40960, qk_norm=True, n_experts=128, top_k=8, moe_ffn_dim=768,
        dense_ffn_dim=6144, route_norm=True, aux_loss_coef=1e-3,
    ),
}


def moe_args_for(flavor: str, *, vocab_size: int = 0, n_layers: int = 0, max_seq_len: int = 0,
                 **moe: Any) -> MoEArgs:
    """An MoE flavor's shapes with overrides (0 keeps the flavor's value; `moe` keys replace MoEArgs fields)."""
    args = MOE_FLAVORS[flavor]
    overrides = {"vocab_size": vocab_size, "n_layers": n_layers}
    args = replace(args, **{k: v for k, v in overrides.items() if v}, **moe)
    if max_seq_len:
        args = replace(args, max_seq_len=max(max_seq_len, args.max_seq_len))
    return args


# ---------------------------------------------------------------------------
# Router


class Router(nn.Module):
    """Token-choice top-k. Scores come from `gate`; `expert_bias` shifts only which experts are chosen."""

    def __init__(self, args: MoEArgs, *, bias: bool = False):
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.score_func, self.route_norm = args.score_func, args.route_norm
        self.gate = nn.Linear(args.dim, args.n_experts, bias=bias)  # bias: GPT-OSS's router
        # Persistent: a resumed run continues with the balance it had reached.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (weights [T, k] fp32, expert ids [T, k], scores [T, E] fp32)."""
        logits = self.gate(x).float()  # routing decisions in fp32 whatever the compute dtype
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        _, idx = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1)
        weights = scores.gather(-1, idx)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx, scores

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float, *, keep: torch.Tensor) -> None:
        """DeepSeek-V3: raise the bias of under-loaded experts, lower it for over-loaded ones.

        The step's mean is subtracted, so the biases keep summing to zero; `keep` (1.0, or 0.0
        for a skipped optimizer step) masks the change on the device, without a host sync.
        """
        delta = rate * torch.sign(load.mean() - load)
        delta = (delta - delta.mean()) * keep
        self.expert_bias += delta.to(self.expert_bias.dtype)


# ---------------------------------------------------------------------------
# The MoE feed-forward and block

# Layout of MoE.stats (one buffer, so one in-place add keeps the counters consistent even when
# activation checkpointing recomputes the forward: every reported number is a ratio of them).
STAT_DROPPED, STAT_AUX, STAT_CALLS = 0, 1, 2  # offsets after the n_experts load counts


class _AuxLossInjector(torch.autograd.Function):
    """Identity on the layer's output whose backward also gives the aux loss the gradient `scale`.

    Megatron's MoEAuxLossAutoScaler: the aux loss joins the objective without being returned,
    so the LM loss path is the same for dense and MoE models and for every pipeline stage.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad_output, scale.clone(), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`output`, unchanged; in backward d(objective)/d(aux_loss) = scale (the LM loss's own factor)."""
    return _AuxLossInjector.apply(output, aux_loss, scale)


def set_aux_loss_scale(modules: list[MoE], scale: torch.Tensor | float) -> None:
    """The factor every MoE layer's aux-loss gradient gets in the next backward: the LM loss's
    (loss scale / (pipeline microbatches x accumulation steps)). A device tensor is copied without a sync."""
    for m in modules:
        if isinstance(scale, torch.Tensor):
            m.aux_grad_scale.copy_(scale)
        else:
            m.aux_grad_scale.fill_(scale)


class MoE(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.aux_loss_coef, self.capacity_factor = args.aux_loss_coef, args.capacity_factor
        self.score_func = args.score_func
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.moe_ffn_dim, args.n_experts)
        self.shared_expert = (
            MLP(args, hidden_dim=args.n_shared_experts * args.moe_ffn_dim) if args.n_shared_experts else None
        )
        # Since the last optimizer step: tokens routed to each expert (before dropping), dropped
        # assignments, sum of aux losses, forward calls. Read and reset by MoEBalancer.
        self.register_buffer("stats", torch.zeros(args.n_experts + 3), persistent=False)
        # d(objective)/d(aux loss) of the next backward, set by the step (set_aux_loss_scale).
        self.register_buffer("aux_grad_scale", torch.ones(()), persistent=False)
        # The ranks that hold the other slices of this rank's sequences (tensor parallel: apply_tp sets the tp
        # group); the sequence-wise aux loss sums its statistics over them. None: whole sequences here.
        self.sequence_group: dist.ProcessGroup | None = None
        # Under context parallelism FSDP averages over the cp ranks a loss each of them holds whole: the
        # aux loss's gradient is injected this many times as strong (apply_cp sets cp's size).
        self.aux_grad_multiplier: float = 1.0

    def set_sequence_group(self, group: dist.ProcessGroup, *, aux_grad_multiplier: float = 1.0) -> None:
        """The ranks holding the other slices of this rank's sequences (apply_tp: the tp group; apply_cp: the cp
        group, with cp's size as the aux loss's gradient multiplier)."""
        self.sequence_group, self.aux_grad_multiplier = group, aux_grad_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, dim] -> output like x; the aux loss (times aux_loss_coef) is attached to it for backward."""
        bsz, seq_len, dim = x.shape
        flat = x.reshape(-1, dim)
        n_tokens, k, n_experts = flat.shape[0], self.top_k, self.n_experts
        weights, idx, scores = self.router(flat)
        experts = idx.reshape(-1)  # assignment a = token * k + j
        load = torch.zeros(n_experts, device=x.device, dtype=torch.float32).index_add_(
            0, experts, torch.ones_like(experts, dtype=torch.float32))
        aux = self._aux_loss(idx.reshape(bsz, seq_len * k), scores.reshape(bsz, seq_len, n_experts))

        keep = self._within_capacity(experts, seq_len) if self.capacity_factor > 0 else None
        # Sort assignments by expert (stable: token order within an expert); dropped ones go last.
        key = experts if keep is None else torch.where(keep, experts, n_experts)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(n_experts + 1, device=x.device, dtype=torch.int64).index_add_(
            0, key, torch.ones_like(key))
        dropped = counts[n_experts]
        counts = counts[:n_experts]
        inverse = inverse_permutation(order)
        # note: a host sync, only with token dropping: the experts get the kept rows only.
        kept = order if keep is None else order[: n_tokens * k - int(dropped)]
        # The shared expert does not need the routed rows: it runs inside the experts' call, after their combine
        # all-to-all starts, so that under ep its GEMMs run while the rows cross (eager: the wait comes at the rows'
        # first use; compiled: moe.overlap_all_to_all). Its output comes back through `shared`, not as the experts':
        # FSDP2 hooks (and under TP warns of, a view) every tensor an FSDP-wrapped module returns. On x [batch, seq,
        # dim]: under TP the shared expert gathers the sequence's slices (Shard(1)).
        shared: list[torch.Tensor] = []
        shared_expert = self.shared_expert
        routed = self.experts(flat, counts, kept, inverse, k,
                              beside=(lambda: shared.append(shared_expert(x))) if shared_expert is not None else None)
        # Weighted and summed over each token's k experts in fp32, then back to the compute dtype.
        out = experts_to_tokens(routed, inverse, order, weights).to(x.dtype)
        if shared:
            out = out + shared[0].reshape(-1, dim)
        if self.training:  # evaluation forwards must not move the balancing bias
            with torch.no_grad():
                self.stats += torch.cat([load, torch.stack([dropped.float(), aux.detach(), torch.ones_like(aux)])])
            if self.aux_loss_coef:
                out = attach_aux_loss(out, self.aux_loss_coef * aux, self.aux_grad_scale * self.aux_grad_multiplier)
        return out.reshape(bsz, seq_len, dim)

    def _aux_loss(self, chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Sequence-wise balance loss: mean over sequences of E * sum_e f_e * P_e.

        f_e = fraction of the sequence's k * seq_len assignments that chose e, P_e = mean
        normalized score of e over the sequence. 1 when perfectly balanced. With a
        `sequence_group` both sums run over the whole sequence: every rank of the group then
        holds the same aux loss, and its gradient reaches each rank's own tokens once.
        """
        bsz, n_assign = chosen.shape
        counts = torch.zeros(bsz, self.n_experts, device=chosen.device).scatter_add_(
            1, chosen, torch.ones_like(chosen, dtype=torch.float32))
        if self.score_func == "sigmoid":
            scores = scores / scores.sum(dim=-1, keepdim=True)
        score_sums, seq_len = scores.sum(dim=1), scores.shape[1]
        if self.sequence_group is not None:
            counts = all_reduce_sum_identity_backward(counts, self.sequence_group)  # counts carry no gradient
            score_sums = all_reduce_sum_identity_backward(score_sums, self.sequence_group)
            slices = dist.get_world_size(self.sequence_group)
            n_assign, seq_len = n_assign * slices, seq_len * slices
        return self.n_experts * ((counts / n_assign) * (score_sums / seq_len)).sum(dim=1).mean()

    def _within_capacity(self, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Per sequence and expert, keep the first ceil(c * seq_len * k / E) assignments in token order."""
        k, n_experts = self.top_k, self.n_experts
        capacity = math.ceil(self.capacity_factor * seq_len * k / n_experts)
        seq = torch.arange(experts.shape[0], device=experts.device) // (seq_len * k)
        group = seq * n_experts + experts
        order = torch.argsort(group, stable=True)
        sizes = torch.zeros(int(group.numel() // (seq_len * k)) * n_experts, device=experts.device,
                            dtype=torch.int64).index_add_(0, group, torch.ones_like(group))
        starts = torch.cumsum(sizes, 0) - sizes
        rank_sorted = torch.arange(order.numel(), device=experts.device) - starts[group[order]]
        rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
        return rank < capacity


class MoEBlock(TransformerBlock):
    """A block whose feed-forward is the MoE layer, at `moe` (fqns `layers.{i}.moe.*`)."""

    ffn_name = "moe"

    def build_ffn(self, args: MoEArgs) -> nn.Module:
        return MoE(args)


class MoETransformer(Decoder):
    """MoE blocks where `args.is_moe_layer(i)`, dense ones elsewhere; `Decoder.forward` runs them."""

    def __init__(self, args: MoEArgs):
        blocks = [MoEBlock(args) if args.is_moe_layer(i) else TransformerBlock(args) for i in range(args.n_layers)]
        super().__init__(args, blocks)

    def init_buffers(self) -> None:
        for module in self.modules():
            if isinstance(module, Router):
                module.expert_bias.zero_()
            elif isinstance(module, MoE):
                module.stats.zero_()
                module.aux_grad_scale.fill_(1.0)


def tp_plan(model: MoETransformer, *, loss_parallel: bool) -> TPPlan:
    """Dense blocks as in Llama; an MoE block's shared experts are tensor-parallel like the dense MLP, its routed
    experts whole: each tp rank routes its own sequence slice (what sequence parallel gives it) through them, so
    the routed path moves no bytes between tp ranks (why not Megatron's expert tensor parallel: docs/moe.md).
    FSDP shards the experts and router over dp_shard x tp (trainer.parallel.fsdp); the aux loss sums its
    statistics over tp (`MoE.sequence_group`: the plan's sequence_modules)."""
    plan = TPPlan(top=decoder_tp_plan(loss_parallel=loss_parallel), blocks={})
    dense = block_tp_plan("mlp", mlp_tp_plan(), qk_norm=model.args.qk_norm)
    for name, block in model.layers.items():
        if not isinstance(block, MoEBlock):
            plan.blocks[name] = dense
            continue
        # The routed path takes this rank's sequence slice as a plain tensor.
        routed = {"": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                         use_local_output=True)}
        shared = prefixed("shared_expert", mlp_tp_plan()) if block.moe.shared_expert is not None else {}
        plan.blocks[name] = block_tp_plan("moe", routed | shared, qk_norm=model.args.qk_norm)
        plan.sequence_modules.append(block.moe)
    if plan.sequence_modules:
        plan.summary = (f"; {len(plan.sequence_modules)} MoE blocks: shared experts tensor-parallel, routed experts "
                        "whole, each tp rank routing its sequence slice")
    return plan


# ---------------------------------------------------------------------------
# Counting


def param_counts(args: MoEArgs) -> tuple[int, int]:
    """(total, active) parameters. Active = what one token passes through: all but the
    n_experts - top_k routed experts it does not choose, and without the embedding table
    (a lookup, no matmul)."""
    n_moe = args.n_moe_layers
    total = param_count(args) - n_moe * args.n_experts  # param_count also counts the expert-bias buffers
    # Active: less the embedding table and the routed experts a token does not choose.
    unchosen = n_moe * (args.n_experts - args.top_k) * 3 * args.dim * args.moe_ffn_dim  # 3 matrices per expert
    return total, total - args.vocab_size * args.dim - unchosen


@dataclass(frozen=True)
class LayerKind:
    """The dense or the MoE blocks of a model (`MoEArgs.is_moe_layer`), as the memory plan reads a run of alike
    blocks: how many, the first, which; in closed form, wherever they lie (no loop over n_layers)."""

    args: MoEArgs
    moe: bool

    def __len__(self) -> int:
        return self.args.n_moe_layers if self.moe else self.args.n_layers - self.args.n_moe_layers

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and 0 <= i < self.args.n_layers and self.args.is_moe_layer(i) == self.moe

    def __getitem__(self, k: int) -> int:
        assert k == 0 and len(self), (k, self)  # the plan asks the first block of a kind that has any
        a = self.args
        if not self.moe:  # block 0, unless every block from 0 routes but the listed ones
            return 0 if a.n_dense_layers or a.sparse_step > 1 else min(a.dense_layers)
        i = (min(a.n_dense_layers, a.n_layers) // a.sparse_step + 1) * a.sparse_step - 1  # the first (i + 1) % step = 0
        while i in a.dense_layers:  # at most len(dense_layers) steps
            i += a.sparse_step
        return i

    def __iter__(self) -> Iterator[int]:
        return (i for i in range(self.args.n_layers) if self.args.is_moe_layer(i) == self.moe)


def block_runs(args: MoEArgs) -> tuple[LayerKind, ...]:
    """The blocks of each kind that has any: the dense ones, then the MoE ones."""
    return tuple(kind for kind in (LayerKind(args, moe=False), LayerKind(args, moe=True)) if len(kind))


def block_params(args: MoEArgs, i: int) -> tuple[int, int]:
    """(parameters of block i, of which routed experts' and their router's: split over ep, never gathered over it)."""
    attention, dense, shared, routed = layer_param_counts(args)
    return (attention + shared + routed, routed) if args.is_moe_layer(i) else (attention + dense, 0)


def activation_bytes(args: MoEArgs, i: int, policy: ActivationPolicy) -> tuple[int, int]:
    """(saved, backward) bytes per token of block i (trainer.models.activations): a dense block's, or an MoE block's
    shared experts as a dense MLP (never FP8) and its top_k routed rows per token."""
    if not args.is_moe_layer(i):
        return block_activation_bytes(args, policy, ffn_dim=args.ffn_dim, fp8_mlp=policy.fp8_mlp)
    return block_activation_bytes(args, policy, ffn_dim=args.n_shared_experts * args.moe_ffn_dim, fp8_mlp=False,
                                  routed_rows=args.top_k, routed_dim=args.moe_ffn_dim)


def moe_flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """Training FLOPs per token on ACTIVE parameters: 6 * N_active + attention (12 * L * H * Dh * S)."""
    _, active = param_counts(args)
    return 6 * active + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
