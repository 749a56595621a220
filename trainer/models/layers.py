"""Pieces every decoder family shares: RoPE, RMSNorm, attention, the dense MLP, the block (attention and a
feed-forward slot the family fills), the head, init, and the pieces of the tensor-parallel plans. The shapes they
take (`ModelArgs`, `RopeScaling`) are trainer.model_values', the torch-free dataclasses the config is made from.

`trainer.models.llama` (dense Llama 3) and `trainer.models.moe` (mixture of experts)
build their blocks from these, so both families name modules the same way
(`layers.{i}.attention.{q,k,v,o}_proj`, `layers.{i}.attention_norm`, `norm`,
`output_head.proj`) and initialize them identically for any sharding.

RoPE uses the "rotate half" layout of Hugging Face transformers, so exported
weights load into `LlamaForCausalLM` without permuting q/k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from trainer.model_values import ModelArgs, RopeScaling, YarnScaling
from trainer.models.documents import attention_mask, document_ids, masked_attention
from trainer.seeds import param_seed


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies with Llama 3 scaling (same as transformers' 'llama3' rope_type), or YaRN's ('yarn')."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if (yarn := getattr(args, "rope_yarn", None)) is not None:
        return yarn_inv_freq(inv_freq, yarn, base=args.rope_theta, dim=args.head_dim).float()
    s = args.rope_scaling
    if s is None:
        return inv_freq.float()
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def yarn_inv_freq(inv_freq: torch.Tensor, yarn: YarnScaling, *, base: float, dim: int) -> torch.Tensor:
    """YaRN: each inverse frequency blends its interpolation (/ factor) and itself by a linear ramp over the
    dimensions whose rotations over the original context lie between beta_slow and beta_fast (transformers'
    `_compute_yarn_parameters`, line for line)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers': no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def rope_cache(args: ModelArgs, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[seq_len, 2, head_dim]: cos and sin, each repeated over the two halves (YaRN: times its attention factor)."""
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, rope_inv_freq(args).to(device))
    emb = torch.cat([freqs, freqs], dim=-1)
    table = torch.stack([emb.cos(), emb.sin()], dim=1)
    yarn = getattr(args, "rope_yarn", None)
    return table if yarn is None else table * yarn.attention_factor


def rope_table_bytes(args: ModelArgs, seq_len: int) -> int:
    """The bytes of the fp32 cos/sin table `rope_cache` builds for `seq_len` positions: [seq_len, 2, head_dim] (what
    the memory plan and a load's host-memory check count)."""
    return seq_len * 2 * args.head_dim * 4


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; rope: [seq, 2, head_dim], or [batch, seq, 2, head_dim] (each token's own
    position: document masking)."""
    cos, sin = rope[..., 0, :].to(x.dtype), rope[..., 1, :].to(x.dtype)
    if rope.dim() == 4:  # per batch row: broadcast over the heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability, return in the input dtype.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class AttentionCore(nn.Module):
    """What every attention module shares: causal SDPA over (q, k, v), or a document mask, or another layout's core
    (context parallel), with the build's SDPA backends. Llama's `Attention` and DeepSeek-V3's MLA
    (trainer.models.mla) project their q, k, v and call `attend`; GPT-OSS's (trainer.models.gpt_oss) overrides it."""

    def __init__(self) -> None:
        super().__init__()
        # (q, k, v) -> output for another layout of the sequence (context parallel sets it:
        # trainer.parallel.context_parallel); None = causal SDPA over the whole local sequence.
        self.attention_core = None
        # SDPA's kernels in order of preference (train.attention_backend, set by the build); None = torch's choice.
        self.sdpa_backends: list[SDPBackend] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | torch.Tensor | None
               ) -> torch.Tensor:
        """q, k, v [batch, heads, seq, head_dim] -> [batch, heads, seq, head_dim]."""
        if self.attention_core is not None:  # its own layout's keys: the document mask is made for them
            return self.attention_core(q, k, v, mask)
        if mask is not None:
            return masked_attention(q, k, v, mask)
        if self.sdpa_backends is not None:
            with sdpa_kernel(self.sdpa_backends, set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(AttentionCore):
    proj_bias = False
    """Biases on q/k/v/o (a family's subclass sets it: GPT-OSS)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        bias = self.proj_bias
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        if args.qk_norm:  # per head, over head_dim: the same weights for every head (Qwen3)
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.qk_norm = args.qk_norm

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: BlockMask | torch.Tensor | None = None
                ) -> torch.Tensor:
        """mask: None (causal over the whole sequence) or a document mask (trainer.models.documents)."""
        bsz, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.k_proj(x).view(bsz, seq_len, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        if rope.dim() == 3:  # one table for every row; else each token's own position (document masking)
            rope = rope[:seq_len]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense blocks' MLP and the MoE shared expert."""

    def __init__(self, args: ModelArgs, hidden_dim: int | None = None):
        super().__init__()
        hidden = hidden_dim or args.ffn_dim
        self.gate_proj = nn.Linear(args.dim, hidden, bias=False)
        self.up_proj = nn.Linear(args.dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Attention, then a feed-forward, each behind an RMSNorm and a residual: every family's block.

    A family picks the feed-forward (`build_ffn`) and the attribute that holds it (`ffn_name`): fqns are a
    contract (checkpoints, Hugging Face export, FP8 filters), so it is `mlp` here (`layers.{i}.mlp.gate_proj`)
    and `moe` in an MoE block (`layers.{i}.moe.experts.w1`, trainer.models.moe.MoEBlock).
    """

    ffn_name = "mlp"

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = self.build_attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        setattr(self, self.ffn_name, self.build_ffn(args))

    def build_attention(self, args: ModelArgs) -> nn.Module:
        return Attention(args)

    def build_ffn(self, args: ModelArgs) -> nn.Module:
        return MLP(args)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: BlockMask | torch.Tensor | None = None
                ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        return h + self.ffn(self.mlp_norm(h))


class OutputHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class SequenceChunks(Protocol):
    """This rank's chunks of each sequence under context parallelism: what the model reads of
    trainer.parallel.context_parallel.ContextParallel (a Protocol: the models sit below trainer.parallel)."""

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens."""
        ...

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequences [batch, S] of every rank's chunks of x [batch, local_len] (ids: no gradient)."""
        ...

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a whole-sequence tensor, along `dim`."""
        ...


class Decoder(nn.Module):
    """Embeddings, a ModuleDict of blocks, final norm and output head; the forward and init every family shares.

    Subclasses build the blocks: each block maps (hidden states, rope) to hidden states.
    """

    def __init__(self, args: ModelArgs, blocks: list[nn.Module]):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps fqns `layers.{i}` stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output_head = OutputHead(args)
        self.tie_weights()
        # Not persistent: derived from args, so checkpoints hold only learned weights.
        self.register_buffer("rope", rope_cache(args, args.max_seq_len, device="meta"), persistent=False)
        # This rank's chunks of each sequence under context parallelism (set_context_parallel); None: whole sequences.
        self.cp: SequenceChunks | None = None
        # data.document_masking: the EOS id that ends a document (set_document_masking); None: one causal sequence.
        self.document_eos: int | None = None

    def tie_weights(self) -> None:
        """With args.tie_word_embeddings, the head's weight is the embeddings' Parameter: one Parameter under two
        names. Moving the model (to_empty, .to) keeps it one (set_data); FSDP2 shards it once, in the unit of the
        embeddings, norm and head (trainer.parallel.fsdp); init draws it once. A load with assign=True gives each
        name its own tensor: call this again after it."""
        if self.args.tie_word_embeddings:
            self.output_head.proj.weight = self.tok_embeddings.weight

    def set_context_parallel(self, cp: SequenceChunks) -> None:
        """Under context parallelism the tokens are this rank's chunks of each sequence: RoPE takes their global
        positions from `cp` (trainer.parallel.context_parallel.apply_cp calls this)."""
        self.cp = cp

    def set_document_masking(self, eos_id: int) -> None:
        """Attention within each document of the packed token rows, RoPE positions restarting at each
        (trainer.models.documents). A pipeline stage after the first and a context-parallel rank take the whole
        rows' tokens as `forward`'s `documents`."""
        self.document_eos = eos_id

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the last block [batch, seq, dim]: what the loss needs (`trainer.loss.LossFn`
        applies the final norm and the output head), and what a pipeline stage hands to the next.

        A pipeline stage (trainer.parallel.pipeline) has None for the modules of other stages; after the first
        it takes the previous stage's hidden states (floating point) instead of token ids.
        Under context parallelism the tokens are this rank's chunks, and RoPE takes their global positions.
        documents: under document masking, the whole rows' token ids [batch, seq] when `tokens` is not them (a
        later pipeline stage's hidden states, this rank's context-parallel chunks); None: `tokens` are.
        """
        h, rope, mask = self.embed(tokens, documents)
        for layer in self.layers.values():
            h = layer(h, rope, *mask)
        return h

    def embed(self, tokens: torch.Tensor, documents: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[BlockMask | torch.Tensor, ...]]:
        """(the first block's input, the RoPE table its tokens take, the blocks' document mask or ()): the
        embeddings, or a pipeline stage's input as it is. documents: as `forward`'s."""
        # A later pipeline stage takes the previous one's hidden states (the last may hold a copy of the
        # embeddings for DeepSeek-V3's MTP modules: trainer.parallel.pipeline).
        h = tokens if tokens.is_floating_point() else self.lookup(tokens)
        rope = self.rope if self.cp is None else self.rope.index_select(0, self.cp.positions(h.shape[1], h.device))
        mask = ()  # the blocks' document mask, when there is one
        if self.document_eos is not None:
            rope, mask = self._document_rope_and_mask(tokens if documents is None else documents, h)
        return h, rope, mask

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids`, a plain tensor (under tensor parallel this rank's sequence shard)."""
        h = self.tok_embeddings(ids)
        if isinstance(h, DTensor):  # tensor parallel: the embeddings' sequence shard
            # Unwrapped here, not by the embeddings' own output hook, so that their FSDP2 unit returns no
            # view (trainer.parallel.tensor_parallel). The local shard is torch's AsyncCollectiveTensor (the
            # reduce-scatter not yet waited for): clone() waits for it under autograd and hands the blocks a plain
            # tensor. A compiled block given the AsyncCollectiveTensor itself swaps it for its waited inner tensor,
            # which has no autograd history (torch 2.13's AOTAutograd, any backend): the embeddings' gradient
            # was zero under tp with train.compile_model (docs/distributed.md#compile-under-tensor-parallel).
            h = h.to_local().clone()
        return h

    def _document_rope_and_mask(self, rows: torch.Tensor, h: torch.Tensor
                                ) -> tuple[torch.Tensor, tuple[BlockMask | torch.Tensor]]:
        """Each local token's RoPE row (its position in its document) and the blocks' document mask, from the whole
        rows' token ids: under context parallelism this rank's chunks of the positions, and the mask of its
        queries against the whole rows' keys (which the cp attention core gathers)."""
        # A later pipeline stage without them would read its hidden states; a cp rank, its own chunks only.
        assert not rows.is_floating_point() and (self.cp is None or rows.shape[1] > h.shape[1]), (
            "document masking needs the whole rows' token ids: Decoder.forward's `documents`")
        docs, positions = document_ids(rows.to(h.device), self.document_eos)
        if self.cp is None:
            return self.rope[positions], (attention_mask(docs),)
        queries = self.cp.positions(h.shape[1], h.device)
        return self.rope[self.cp.shard(positions)], (attention_mask(docs, queries),)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for evaluation and generation: forward, final norm, output head."""
        return self.output_head(self.norm(self(tokens)))

    # -- initialization ----------------------------------------------------

    def init_weights(self, *, seed: int) -> None:
        """Pretraining init, identical for any sharding of the parameters.

        Each parameter is drawn whole from a generator seeded by (seed, fqn) and the
        local shard copied out, so a 1-process run and any FSDP/TP/EP layout start from
        the same weights. Only one full parameter exists at a time.
        """
        device = next(self.parameters()).device  # not tok_embeddings': a pipeline stage may have none
        self.rope = rope_cache(self.args, self.args.max_seq_len, device=device)
        for fqn, param in self.named_parameters():
            fqn = clean_fqn(fqn)
            std = self.init_std(fqn)
            with torch.no_grad():
                _fill(param, fqn, seed=seed, std=std)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Persistent buffers a family adds (MoE expert biases); nothing for dense models."""

    def init_std(self, fqn: str) -> float | None:
        """None = ones (norm weights); otherwise the std of a truncated normal."""
        if fqn.endswith("norm.weight"):
            return None
        if fqn.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
            # Depth-scaled: residual branches sum over 2 * n_layers contributions.
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        if fqn == "output_head.proj.weight":
            return self.args.dim**-0.5
        return 0.02


def clean_fqn(fqn: str) -> str:
    """Strip wrapper names added by activation checkpointing and torch.compile."""
    return fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _fill(param: torch.Tensor, fqn: str, *, seed: int, std: float | None) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param
    if std is None:
        local.fill_(1.0)
        return
    device = local.device
    full = torch.empty(param.shape, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(param_seed(seed, fqn))
    nn.init.trunc_normal_(full, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        full = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    local.copy_(full)


def num_params(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        n -= model.tok_embeddings.weight.numel()
    return n



# ---------------------------------------------------------------------------
# Tensor parallel: the pieces of every family's plan (trainer.parallel.tensor_parallel.apply_tp applies it)


@dataclass
class TPPlan:
    """A family's tensor-parallel plan for one model: what `apply_tp` applies, module fqn -> parallel style."""

    top: dict[str, ParallelStyle]
    """The modules outside the blocks (embeddings, final norm, output head), fqns relative to the model."""
    blocks: dict[str, dict[str, ParallelStyle]]
    """Each block's plan by its name in `model.layers`, fqns relative to the block."""
    sequence_modules: list[nn.Module] = field(default_factory=list)
    """Modules that sum statistics over whole sequences (the MoE aux loss): apply_tp sets their `sequence_group`
    to the tp group, whose ranks hold the other slices of each sequence."""
    summary: str = ""
    """What the family adds to apply_tp's log line."""


def decoder_tp_plan(*, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Embeddings, final norm and head: activations between blocks are sharded on the sequence dim; with
    loss_parallel the logits stay sharded over the vocabulary (the loss runs under `loss_parallel()`)."""
    return {
        # Hands its sequence shard on as a DTensor, which the model's forward unwraps
        # (trainer.models.layers.Decoder.forward): to_local() returns a view of the DTensor's local
        # tensor, and the embeddings are an FSDP2 unit of their own (trainer.parallel.fsdp), which
        # must not return a view (FSDP2 warns, docs/debug.md).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                          use_local_output=False),
        "norm": SequenceParallel(),
        "output_head.proj": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def block_tp_plan(ffn_name: str, ffn_plan: dict[str, ParallelStyle], *, qk_norm: bool = False
                  ) -> dict[str, ParallelStyle]:
    """A block's plan: Megatron-style attention (column-parallel q/k/v, row-parallel o: one all-gather in and
    one reduce-scatter out), sequence-parallel norms, then the feed-forward's own plan under its attribute.

    With qk_norm, the per-head norms see this rank's heads (dim 2 of [batch, seq, heads, head_dim]): their
    weights are replicated over the tp ranks and their gradients summed over them (the heads' shares)."""
    heads = {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")}
    return (heads if qk_norm else {}) | {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(  # (x, rope, document mask): only x is sequence-sharded
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.q_proj": ColwiseParallel(),
        "attention.k_proj": ColwiseParallel(),
        "attention.v_proj": ColwiseParallel(),
        "attention.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
    } | prefixed(ffn_name, ffn_plan)


def mlp_tp_plan() -> dict[str, ParallelStyle]:
    """The SwiGLU MLP (dense blocks, MoE shared experts): gathers the sequence, column-parallel gate/up,
    row-parallel down back to sequence shards. The key "" is the MLP itself."""
    return {
        "": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        "gate_proj": ColwiseParallel(),
        "up_proj": ColwiseParallel(),
        "down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def prefixed(prefix: str, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan`'s fqns under the submodule `prefix` (the key "" is the submodule itself)."""
    return {f"{prefix}.{fqn}" if fqn else prefix: style for fqn, style in plan.items()}
