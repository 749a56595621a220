"""GPT-OSS (OpenAI's gpt-oss-20b / -120b; transformers' GptOssForCausalLM): an MoE decoder built from the MoE
family's pieces, with what GPT-OSS adds:

    layers.{i}.attention.{q,k,v,o}_proj.{weight,bias}   attention with biases (GQA)
    layers.{i}.attention.sinks                          [n_heads]: a learned logit per head that joins each query's
                                                        softmax denominator (trainer.models.sink_attention)
    layers.{i}.moe.router.gate.{weight,bias}            the router, with a bias; softmax over the top_k logits
    layers.{i}.moe.router.expert_bias                   the aux-loss-free balancing bias (ours; 0 in an import)
    layers.{i}.moe.experts.w13 [E, 2 x hidden, dim]     the gate's rows, then the up projection's (one tensor, as
    layers.{i}.moe.experts.b13 [E, 2 x hidden]          transformers stores gate_up_proj, interleaved there)
    layers.{i}.moe.experts.{w2 [E, dim, hidden], b2 [E, dim]}   the down projection

The experts are the MoE family's `GroupedExperts` (dispatch -> grouped GEMMs -> combine, expert parallelism alike)
with their weights stored fused, biases, and the clamped SwiGLU (`ClampedSwiGLU`). Every block is MoE (no dense
blocks, no shared experts). Layer i attends within a sliding window of `sliding_window` keys unless (i + 1) is a
multiple of `full_attention_interval`. RoPE is YaRN-scaled (trainer.models.layers.yarn_inv_freq).

Routing: transformers takes the softmax of the top_k router logits; ours takes the softmax over every expert, the
top_k of it, renormalized to sum 1 (score_func "softmax", route_norm): the same weights, and the full softmax is what
the aux loss and the balancing bias read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from trainer.model_values import GptOssArgs, YarnScaling
from trainer.models.activations import ActivationPolicy, block_activation_bytes
from trainer.models.counts import layer_param_counts, param_count
from trainer.models.layers import Attention, Decoder, TPPlan
import trainer.models.moe as moe
from trainer.models.moe import MoE, MoEBlock, MoETransformer, Router
from trainer.models.moe_experts import GroupedExperts, _local
from trainer.models.sink_attention import chunk_sink_attention, sink_attention

# `debug_gpt_oss` trains on a CPU in seconds (its YaRN and window matter at its sequence lengths);
# `gpt_oss_20b` is openai/gpt-oss-20b's published shape (20.9B parameters, 3.6B active).
FLAVORS: dict[str, GptOssArgs] = {
    "debug_gpt_oss": GptOssArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, rope_theta=10000.0,
        rope_yarn=YarnScaling(factor=4.0, original_max_seq_len=32), n_experts=8, top_k=2, moe_ffn_dim=64,
        dense_ffn_dim=64, route_norm=True, aux_loss_coef=0.01, bias_update_rate=0.0, sliding_window=16,
    ),
    "gpt_oss_20b": GptOssArgs(
        dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, explicit_head_dim=64, vocab_size=201088, norm_eps=1e-5,
        rope_theta=150000.0, rope_yarn=YarnScaling(factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                   original_max_seq_len=4096, truncate=False),
        max_seq_len=4096, n_experts=32, top_k=4, moe_ffn_dim=2880, dense_ffn_dim=2880, route_norm=True,
        aux_loss_coef=1e-3, bias_update_rate=0.0, sliding_window=128,
    ),
}


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssExperts(GroupedExperts):
    """GroupedExperts whose gate and up projections are one tensor (w13), with biases, gated by ClampedSwiGLU."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, *, glu: ClampedSwiGLU):
        super().__init__(dim, hidden_dim, n_experts)
        self.glu = glu

    def make_parameters(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.b13 = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim))
        self.b2 = nn.Parameter(torch.empty(n_experts, dim))

    def local_weights(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict[str, Any]]:
        w13, w2, b13, b2 = (self.local(w) for w in (self.w13, self.w2, self.b13, self.b2))
        hidden = w2.shape[-1]
        # Views of the one tensor: the grouped GEMM takes each expert's [hidden, dim] block as it lies.
        w1, w3 = w13[:, :hidden], w13[:, hidden:]
        return (w1, w2, w3), {"biases": (b13[:, :hidden], b2, b13[:, hidden:]), "glu": self.glu}


class GptOssMoE(MoE):
    """The MoE layer with a biased router and GptOssExperts."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args)
        self.router = Router(args, bias=True)
        self.experts = GptOssExperts(args.dim, args.moe_ffn_dim, args.n_experts,
                                     glu=ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit))


class GptOssAttention(Attention):
    """GQA attention with q/k/v/o biases, a sink logit per head and, on sliding layers, a window of `window` keys."""

    proj_bias = True

    def __init__(self, args: GptOssArgs):
        super().__init__(args)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        self.window = 0  # the whole causal sequence; GptOssBlock sets a sliding layer's

    def attend(self, q, k, v, mask):
        sinks = _local(self.sinks)  # under tensor parallel, this rank's heads' (tp_plan shards them with the heads)
        core = self.attention_core
        if core is not None:  # context parallel (trainer.parallel.context_parallel.CPAttention): the whole K, V
            k, v = core.gather(k, v)
            if mask is not None:  # documents: the mask of this rank's queries, at their global positions
                return sink_attention(q, k, v, sinks, window=self.window, mask=mask,
                                      positions=core.cp.positions(q.shape[2], q.device))
            return chunk_sink_attention(q, k, v, sinks, window=self.window, chunks=core.cp.chunks())
        return sink_attention(q, k, v, sinks, window=self.window, mask=mask)


class GptOssBlock(MoEBlock):
    def __init__(self, args: GptOssArgs, i: int):
        super().__init__(args)
        self.attention.window = args.sliding_window if args.is_sliding(i) else 0

    def build_attention(self, args: GptOssArgs) -> nn.Module:
        return GptOssAttention(args)

    def build_ffn(self, args: GptOssArgs) -> nn.Module:
        return GptOssMoE(args)


# Zero at init, as transformers initializes them: the attention and expert biases.
_ZERO_INIT = ("_proj.bias", "experts.b13", "experts.b2")


class GptOssTransformer(MoETransformer):
    def __init__(self, args: GptOssArgs):
        Decoder.__init__(self, args, [GptOssBlock(args, i) for i in range(args.n_layers)])

    def init_weights(self, *, seed: int) -> None:
        """The shared init (truncated normal per fqn: the router's bias and the sinks std 0.02), then the attention
        and expert biases zero."""
        super().init_weights(seed=seed)
        with torch.no_grad():
            for fqn, param in self.named_parameters():
                if fqn.endswith(_ZERO_INIT):
                    param.zero_()


class _AttentionWithSinks(ParallelStyle):
    """The block plan's style for the attention (its input: the gathered sequence), after which the attention's
    sinks are sharded with its heads: Shard(0) over tp, as the column-parallel q/k/v give each rank its heads."""

    def __init__(self, inputs: ParallelStyle):
        super().__init__()
        self.inputs = inputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module.sinks
        module.register_parameter("sinks", nn.Parameter(distribute_tensor(sinks.detach(), device_mesh, [Shard(0)]),
                                                        requires_grad=sinks.requires_grad))
        return self.inputs._apply(module, device_mesh)


def tp_plan(model: GptOssTransformer, *, loss_parallel: bool) -> TPPlan:
    """The MoE family's plan (Megatron-style attention, its biases sharded with their Linears' outputs: q/k/v's
    column-wise, o's replicated; routed experts whole, each tp rank routing its sequence slice), with each
    attention's sinks sharded with its heads."""
    plan = moe.tp_plan(model, loss_parallel=loss_parallel)
    for block in plan.blocks.values():
        block["attention"] = _AttentionWithSinks(block["attention"])
    plan.summary += "; attention sinks sharded with their heads"
    return plan


# ---------------------------------------------------------------------------
# Counting


def param_counts(args: GptOssArgs) -> tuple[int, int]:
    """(total, active) parameters: active less the embedding table and the experts a token does not choose (their
    weights and biases)."""
    n_moe = args.n_moe_layers  # every block (trainer.validate.layout refuses dense ones)
    total = param_count(args) - n_moe * args.n_experts  # param_count also counts the expert-bias buffers
    d, h = args.dim, args.moe_ffn_dim
    unchosen = n_moe * (args.n_experts - args.top_k) * (3 * d * h + 2 * h + d)
    return total, total - args.vocab_size * d - unchosen


def ffn_params(args: GptOssArgs, i: int) -> int:
    """Matmul parameters a token passes through in block i's feed-forward: top_k experts and the router."""
    return 3 * args.dim * args.moe_ffn_dim * args.top_k + args.dim * args.n_experts


def block_runs(args: GptOssArgs) -> tuple[range, ...]:
    """Every block is alike in parameters and activations (a window changes neither)."""
    return (range(args.n_layers),)


def block_params(args: GptOssArgs, i: int) -> tuple[int, int]:
    """(parameters of block i, of which routed experts' and the router's: split over ep, never gathered over it)."""
    attention, _, _, routed = layer_param_counts(args)
    return attention + routed, routed


def activation_bytes(args: GptOssArgs, i: int, policy: ActivationPolicy) -> tuple[int, int]:
    """(saved, backward) bytes per token of block i: an MoE block without shared experts, and the sink's fp32 output
    product (4 x n_heads x head_dim + 8 x n_heads, the GPU path's; estimated, not yet measured)."""
    saved, backward = block_activation_bytes(args, policy, ffn_dim=0, fp8_mlp=False, routed_rows=args.top_k,
                                             routed_dim=args.moe_ffn_dim)
    sink = 4 * args.n_heads * args.head_dim + 8 * args.n_heads  # out.float() [fp32], sigmoid(lse - sink) twice
    return (saved if policy.ac == "full" else saved + sink), backward + (sink if policy.ac == "full" else 0)


def flops_per_token(args: GptOssArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the active parameters, plus attention (12 x H x Dh x the keys a query sees: the
    whole sequence on full layers, at most sliding_window on sliding ones)."""
    _, active = param_counts(args)
    n_full = args.n_layers // args.full_attention_interval if args.sliding_window else args.n_layers
    keys = n_full * seq_len + (args.n_layers - n_full) * min(seq_len, args.sliding_window)
    return 6 * active + 12 * args.n_heads * args.head_dim * keys
