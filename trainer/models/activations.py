"""What a block saves for backward, in bytes per token: the blocks every family builds from trainer.models.layers
(attention, norms, a SwiGLU feed-forward; an MoE block's routed experts), as the dry run's memory plan counts them
(trainer/validate/plan.py asks each family: `ModelFamily.activation_bytes`).

d = dim, q = n_heads x head_dim, kv = n_kv_heads x head_dim, h = n_heads, f = the feed-forward's width (a dense
block's ffn_dim; an MoE block's shared experts, n_shared_experts x moe_ffn_dim). Read from the forward graphs
torch.compile's partitioner makes for our block (the saved outputs of its post-grad forward graph, on a CPU; the same
op graph on a GPU: tests/unit/test_memory_plan_graphs.py) and confirmed against what was live at the measured peaks on
1x H100 (docs/benchmarks.md, "The dry run's memory plan"):

    compiled, bf16 linears          8d + 4q + 4kv + 4h + 6f + 8   inputs and outputs of the norms and their fp32
                                                                  rstd, q/k/v, attention out and its logsumexp,
                                                                  gate, up and their product
    compiled, fp8 linears           4d + 4q + 4kv + 4h + 4f + 8   the normed inputs, o_proj's output and the
                                                                  product are recomputed from what the casts need
    ... with float8.scaling=delayed  + 3d                         q, k and v cast their shared input with three
                                                                  scales: the three fp8 casts are kept
    selective AC (per-op policy)    4d + 4q + 4kv + 4h + 4f       the GEMM and attention outputs only: what the
                                                                  compiled fp8 block keeps anyway (the plan notes it)
    full AC                         2d                            the block's input; backward recomputes one block
    eager (no compile)              12d + 4q + 4kv + 4h + 8f + 8  fp32 copies of the norms' inputs, silu's output
    qk_norm adds (not selective)    2q + 2kv + 4(h + n_kv_heads)  the projections' outputs, the heads' rstd

An MoE block adds, per routed row (top_k rows per token), 6d + 6 moe_ffn_dim compiled (the permuted and padded
inputs, both expert GEMMs' outputs, their product, the down projection's output), 6d + 8 moe_ffn_dim eager, and
2d + 4 moe_ffn_dim under selective AC; its shared experts are a dense MLP that never runs in FP8.

The bytes above are a bf16 (or fp8) run's, whose activations are 2-byte; an fp32 run's (every CPU run's default)
are twice them (the fp32 rstd and logsumexp counted twice: a few bytes). Document masking on a CPU adds s x c
bytes per token to every block, s = seq_len and c the activation's bytes: scaled_dot_product_attention converts the
dense boolean mask [batch, 1, s, s] (trainer.models.documents) to the compute dtype and saves that copy for backward,
in every block (measured on the debug model: s x 4 + 32 bytes in fp32, s x 2 + 128 in bf16; a GPU's
FlexAttention BlockMask is a few bytes per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.model_values import ModelArgs


@dataclass(frozen=True)
class ActivationPolicy:
    """How the blocks run, as far as what they save for backward goes."""

    compiled: bool
    ac: Literal["none", "selective", "full"] = "none"
    """Activation checkpointing of this block: "selective" is the per-op policy (GEMM and attention outputs kept)."""
    fp8_attention: bool = False
    """q/k/v/o projections in FP8."""
    fp8_mlp: bool = False
    """The dense MLP's projections in FP8 (shared and routed experts never are, as Linears)."""
    fp8_delayed: bool = False
    """float8.scaling='delayed' (with fp8_attention): q, k and v keep their three fp8 casts."""
    compute_bytes: int = 2
    """An activation's bytes: 2 (bf16 and fp8 runs) or 4 (fp32 runs)."""
    dense_mask_seq: int = 0
    routed_slots: int = 1
    """Copies of the routed rows the experts' buffers hold: ep under moe.dispatch='padded' (each rank receives a slot
    of every rank's rows, most of them empty), else 1."""
    """Document masking on a CPU: the sequence length of the dense mask each block's attention saves (module
    docstring); 0 without (a GPU's BlockMask, or no document masking)."""


def block_activation_bytes(args: ModelArgs, policy: ActivationPolicy, *, ffn_dim: int, fp8_mlp: bool,
                           routed_rows: int = 0, routed_dim: int = 0) -> tuple[int, int]:
    """(saved, backward) bytes per token of one block: what backward finds saved, and what the block's backward adds
    to it (a fully checkpointed block's activations again, and its feed-forward's gradients). `ffn_dim`: the SwiGLU
    MLP's width (0: none); `routed_rows` rows per token through routed experts of width `routed_dim`."""
    d, h = args.dim, args.n_heads
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    f, rows, hidden = ffn_dim, routed_rows * policy.routed_slots, routed_dim
    sdpa = 4 * q + 4 * kv + 4 * h  # q, k, v, out, lse
    # qk_norm: the q and k projections' outputs and the per-head norms' fp32 rstd (selective AC saves the former)
    qk_norm = 2 * q + 2 * kv + 4 * (h + args.n_kv_heads) if args.qk_norm else 0
    if not policy.compiled:
        full = 12 * d + 8 + sdpa + qk_norm + 8 * f + rows * (6 * d + 8 * hidden)
    else:  # 8: the two norms' fp32 rstd
        # Each routed row: its d-wide row in token order (the output the router's weights scale) and, in each of the
        # `routed_slots` copies, the experts' padded input and their three hidden-wide tensors (gate, up, product).
        full = ((4 if policy.fp8_attention else 6) * d + 8 + sdpa + qk_norm + (4 * f if fp8_mlp else 2 * d + 6 * f)
                + routed_rows * (2 * d + policy.routed_slots * (2 * d + 6 * hidden)))
        if policy.fp8_attention and policy.fp8_delayed:
            full += 3 * d  # tests/unit/test_float8_scaling_compile.py
    # A block's backward allocates its MLP's three gradients (of the gate, up and their product: compute dtype) on
    # top of what it finds saved; only the loss's transient hid them until long sequences (1x H200, 32K-128K).
    grads = 6 * f + rows * 6 * hidden
    mask = policy.dense_mask_seq * 2  # in bf16 units, as every count here: scaled below
    full += mask
    if policy.ac == "full":
        saved, backward = 2 * d, full + grads
    elif policy.ac == "selective":  # the GEMMs' and attention's outputs (and attention's inputs, the mask among them)
        saved, backward = min(full, 4 * d + sdpa + 4 * f + rows * (2 * d + 4 * hidden) + mask), grads
    else:
        saved, backward = full, grads
    return saved * policy.compute_bytes // 2, backward * policy.compute_bytes // 2
