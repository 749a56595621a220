"""Model families: what differs between dense Llama and MoE, in one place, resolved once from the args.

    family_of(args).build(args)                     the model (under `torch.device("meta")` it allocates nothing)
    family_of(args).flops_per_token(args, seq)      training FLOPs per token for MFU (MoE: active parameters)
    family_of(args).param_counts(args)              (total, active) parameters
    family_of(args).tp_plan(model, ...)             the tensor-parallel plan trainer.parallel.tensor_parallel applies
    family_of(args).block_params(args, i)           block i's parameters (the memory plan; block_runs groups alike
    family_of(args).activation_bytes(args, i, ...)  blocks) and what it saves for backward per token
    family_of(args).describe(args)                  the family's startup line, or None
    family_of(args).has_router                      routed experts: the [moe] section, EP, the MoE balancer hook

A family's Hugging Face mapping is `trainer/hf/<name>.py` (trainer.hf finds it by `name`).
Everything else (attention, norms, the dense MLP, the head, init, the block) is shared: trainer.models.layers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from torch import nn

from trainer.models.counts import param_count
from trainer.models.activations import ActivationPolicy
from trainer.models.layers import ModelArgs, TPPlan
import trainer.models.deepseek_v3 as deepseek_v3
import trainer.models.gpt_oss as gpt_oss
import trainer.models.llama as llama  # the modules, not `from trainer.models import`: the package imports this one
import trainer.models.moe as moe


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """"llama", "moe", "deepseek_v3" or "gpt_oss"; also the name of its export mapping, trainer/hf/<name>.py."""
    flavors: dict[str, ModelArgs]
    build: Callable[[ModelArgs], nn.Module]
    flops_per_token: Callable[[ModelArgs, int], float]
    param_counts: Callable[[ModelArgs], tuple[int, int]]
    """(total, active): active = what one token's forward passes through, without the embedding table."""
    ffn_params: Callable[[ModelArgs, int], int]
    """Matmul parameters a token passes through in block i's feed-forward (the pipeline split's costs)."""
    block_runs: Callable[[ModelArgs], tuple[Collection[int], ...]]
    """The blocks in runs of alike ones (the same parameters and activations; a range, or the MoE family's blocks of
    one kind wherever they lie): what the memory plan counts in closed form, one block of each run (`run[0]`)
    standing for the run."""
    block_params: Callable[[ModelArgs, int], tuple[int, int]]
    """(parameters of block i, of which routed experts': split over ep, never gathered over it)."""
    activation_bytes: Callable[[ModelArgs, int, ActivationPolicy], tuple[int, int]]
    """(saved, backward) bytes per token of block i: what backward finds saved, and what the block's backward adds
    (trainer.models.activations)."""
    tp_plan: Callable[..., TPPlan]
    """tp_plan(model, *, loss_parallel) -> TPPlan."""
    describe: Callable[[ModelArgs], str | None]
    """The family's own startup line (after `Model:`), or None."""
    has_router: bool
    """Routed experts: MoE options, expert parallelism, the balancer hook, FP8 grouped GEMMs apply."""


def _dense_param_counts(args: ModelArgs) -> tuple[int, int]:
    total = param_count(args)
    return total, total - args.vocab_size * args.dim


def _dense_ffn_params(args: ModelArgs, i: int) -> int:
    return 3 * args.dim * args.ffn_dim


def _moe_ffn_params(args: moe.MoEArgs, i: int) -> int:
    if not args.is_moe_layer(i):
        return _dense_ffn_params(args, i)
    # The shared experts and the top_k routed experts a token passes through, and the router.
    return 3 * args.dim * args.moe_ffn_dim * (args.n_shared_experts + args.top_k) + args.dim * args.n_experts


def _describe_moe(args: moe.MoEArgs) -> str:
    return (
        "MoE: %s active parameters per token (MFU counts these); %d routed experts top-%d (%s scores%s), "
        "%d shared, %d dense layers; aux_loss_coef=%g, bias_update_rate=%g, capacity_factor=%g" % (
            f"{moe.param_counts(args)[1]:,}", args.n_experts, args.top_k, args.score_func,
            ", renormalized" if args.route_norm else "", args.n_shared_experts, args.n_layers - args.n_moe_layers,
            args.aux_loss_coef, args.bias_update_rate, args.capacity_factor,
        )
    )


LLAMA = ModelFamily(
    name="llama", flavors=llama.FLAVORS, build=llama.Llama, flops_per_token=llama.flops_per_token,
    param_counts=_dense_param_counts, ffn_params=_dense_ffn_params, block_runs=llama.block_runs,
    block_params=llama.block_params, activation_bytes=llama.activation_bytes, tp_plan=llama.tp_plan,
    describe=lambda args: None, has_router=False,
)
MOE = ModelFamily(
    name="moe", flavors=moe.MOE_FLAVORS, build=moe.MoETransformer, flops_per_token=moe.moe_flops_per_token,
    param_counts=moe.param_counts, ffn_params=_moe_ffn_params, block_runs=moe.block_runs,
    block_params=moe.block_params, activation_bytes=moe.activation_bytes, tp_plan=moe.tp_plan,
    describe=_describe_moe, has_router=True,
)
DEEPSEEK_V3 = ModelFamily(
    name="deepseek_v3", flavors=deepseek_v3.FLAVORS, build=deepseek_v3.DeepseekV3,
    flops_per_token=deepseek_v3.flops_per_token, param_counts=deepseek_v3.param_counts,
    ffn_params=_moe_ffn_params, block_runs=deepseek_v3.block_runs, block_params=deepseek_v3.block_params,
    activation_bytes=deepseek_v3.activation_bytes, tp_plan=deepseek_v3.tp_plan, describe=deepseek_v3.describe,
    has_router=True,
)
GPT_OSS = ModelFamily(
    name="gpt_oss", flavors=gpt_oss.FLAVORS, build=gpt_oss.GptOssTransformer, flops_per_token=gpt_oss.flops_per_token,
    param_counts=gpt_oss.param_counts, ffn_params=gpt_oss.ffn_params, block_runs=gpt_oss.block_runs,
    block_params=gpt_oss.block_params, activation_bytes=gpt_oss.activation_bytes, tp_plan=gpt_oss.tp_plan,
    describe=lambda args: "GPT-OSS: sliding window %d on %d of %d layers, attention sinks; " % (
        args.sliding_window, sum(map(args.is_sliding, range(args.n_layers))), args.n_layers) + _describe_moe(args),
    has_router=True,
)
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, MOE, DEEPSEEK_V3, GPT_OSS)}


def family_of(args: ModelArgs) -> ModelFamily:
    """The family of these args: DeepseekV3Args are DeepSeek-V3's, GptOssArgs GPT-OSS's, other MoEArgs the MoE
    family's, plain ModelArgs dense Llama's."""
    if isinstance(args, deepseek_v3.DeepseekV3Args):
        return DEEPSEEK_V3
    if isinstance(args, gpt_oss.GptOssArgs):
        return GPT_OSS
    return MOE if isinstance(args, moe.MoEArgs) else LLAMA
