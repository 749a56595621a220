"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values expanded from one low-rank latent per token,
and a RoPE key shared by every head.

Module names are a contract (FP8 filter, checkpoints, the Hugging Face mapping trainer/hf/deepseek_v3.py):

    attention.q_proj                  dim -> n_heads x (qk_nope_head_dim + qk_rope_head_dim)     (q_lora_rank = 0)
    attention.q_a_proj                dim -> q_lora_rank                                          (q_lora_rank > 0)
    attention.q_a_layernorm           RMSNorm over q_lora_rank
    attention.q_b_proj                q_lora_rank -> n_heads x (qk_nope_head_dim + qk_rope_head_dim)
    attention.kv_a_proj_with_mqa      dim -> kv_lora_rank + qk_rope_head_dim (the latent, then the shared RoPE key)
    attention.kv_a_layernorm          RMSNorm over kv_lora_rank
    attention.kv_b_proj               kv_lora_rank -> n_heads x (qk_nope_head_dim + v_head_dim)
    attention.o_proj                  n_heads x v_head_dim -> dim

Each query head is [nope | rope]; each key head is [its own nope part from the latent | the shared RoPE key]. RoPE
rotates "rotate half" pairs (j, j + half) as trainer.models.layers does; DeepSeek's published weights rotate
interleaved pairs (2j, 2j + 1), which the Hugging Face mapping permutes (rope_interleave). The softmax scale is
1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale(mscale_all_dim)^2 with `rope_yarn`
(transformers' DeepseekV3Attention: `yarn_apply_mscale`), applied by scaling q before SDPA (so context parallel's and
the document mask's attention take it too). A value head narrower or wider than the query head is
padded with zeros to the query's width for SDPA (which the flash kernels need) and cut back after: the padded
columns of the output are zero and dropped, so the result is exact.

The low-rank norms use eps 1e-6 whatever model.norm_eps is, as transformers' DeepseekV3Attention builds them.

Tensor parallel (`mla_tp_plan`, as torchtitan's deepseek_v3 plan): q_b_proj, kv_b_proj (or the plain q_proj)
column-parallel over the heads, o_proj row-parallel; q_a_proj, kv_a_proj_with_mqa and their norms, which normalize
over their whole width, replicated over the tp ranks (their weights Replicate DTensors, fed the gathered sequence).
Their gradients are whole on every rank: the column-parallel layers after them sum their input's gradient over the
tp ranks in backward, and so does `rope_key` for the RoPE key, which each rank's heads share (an identity here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.nn.attention.flex_attention import BlockMask

from trainer.model_values import DeepseekV3Args
from trainer.models.layers import AttentionCore, RMSNorm, apply_rope

LOW_RANK_NORM_EPS = 1e-6
"""transformers' DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep (not rms_norm_eps)."""


class MLA(AttentionCore):
    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        d, h = args.dim, args.n_heads
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.qk_dim, self.kv_lora_rank = args.qk_head_dim, args.kv_lora_rank
        self.q_lora_rank = args.q_lora_rank
        # YaRN's mscale on the softmax scale (1 without YaRN): q is multiplied by it, SDPA keeps its 1/sqrt(width).
        self.softmax_factor = 1.0 if args.rope_yarn is None else args.rope_yarn.softmax_factor
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LOW_RANK_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, h * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, LOW_RANK_NORM_EPS)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        # The RoPE key every head shares: an identity, where tensor parallel sums its gradient over the tp ranks,
        # each of which holds some heads' share of it (mla_tp_plan). No parameters.
        self.rope_key = nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: BlockMask | torch.Tensor | None = None
                ) -> torch.Tensor:
        """x [batch, seq, dim]; rope [seq, 2, qk_rope_head_dim] (or per row under document masking)."""
        bsz, seq_len, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(bsz, seq_len, -1, self.qk_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rot = self.rope_key(k_rot)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(bsz, seq_len, -1, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        if rope.dim() == 3:  # one table for every row; else each token's own position (document masking)
            rope = rope[:seq_len]
        q_rot, k_rot = apply_rope(q_rot, rope), apply_rope(k_rot.unsqueeze(1), rope)
        n_heads = q.shape[1]
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, n_heads, -1, -1)], dim=-1)  # the RoPE key is every head's
        q_scale = self.softmax_factor
        if self.v_dim != self.qk_dim:  # SDPA's kernels take one head width: zero columns, dropped after
            v = F.pad(v, (0, self.qk_dim - self.v_dim)) if self.v_dim < self.qk_dim else v
            q_pad = self.v_dim - self.qk_dim
            if q_pad > 0:  # a value head wider than the query's: pad q and k alike (q.k unchanged), keep the scale
                q_scale *= self.qk_dim**-0.5 * self.v_dim**0.5
                q, k = F.pad(q, (0, q_pad)), F.pad(k, (0, q_pad))
        if q_scale != 1.0:
            q = q * q_scale
        out = self.attend(q, k, v, mask)[..., : self.v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))


# ---------------------------------------------------------------------------
# Tensor parallel (trainer.models.deepseek_v3.tp_plan puts this under each block's `attention.`)


class ReplicateParallel(ParallelStyle):
    """A module computed whole on every tp rank (torchtitan's NoParallel): its parameters Replicate DTensors, its
    input (already whole: the gathered sequence) and output plain tensors. The output's gradient must be whole and
    the same on every rank, as the column-parallel layers after MLA's low-rank projections make it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def wrap(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        return distribute_module(module, device_mesh, replicate, input_fn=wrap,
                                 output_fn=lambda mod, out, mesh: out.to_local())


class SumGradient(ParallelStyle):
    """Identity forward; backward sums the output's gradient over the tp ranks (Megatron's copy to the tensor
    parallel region), for a tensor each rank uses only a part of."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partial_gradient(mod: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(out, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])

        module.register_forward_hook(partial_gradient)
        return module


def mla_tp_plan(attention: MLA) -> dict[str, ParallelStyle]:
    """MLA's plan, fqns relative to the attention module (the module docstring): heads split over the tp ranks."""
    q = ({"q_a_proj": ReplicateParallel(), "q_a_layernorm": ReplicateParallel(), "q_b_proj": ColwiseParallel()}
         if attention.q_lora_rank else {"q_proj": ColwiseParallel()})
    return q | {"kv_a_proj_with_mqa": ReplicateParallel(), "kv_a_layernorm": ReplicateParallel(),
                "kv_b_proj": ColwiseParallel(), "rope_key": SumGradient()}
