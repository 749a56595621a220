"""The model's sizes in closed form from its arguments alone (no model built, no loop over layers: a crafted n_layers
of 1e12 costs nothing to count): parameters per block kind, in all, as the startup line counts them, the state dict's
tensors, and whether a checkpoint's or a config.json's files can hold what its arguments imply.

Torch-free like trainer.model_values, whose dataclasses these read; trainer.models' families, the memory plan
(trainer/validate), the checkpoint and Hugging Face readers use them.
"""

from __future__ import annotations


from trainer.model_values import EDITED, MIN_BYTES_PER_PARAM, DeepseekV3Args, GptOssArgs, ModelArgs, size_text


def mla_param_count(args: DeepseekV3Args) -> int:
    """One MLA attention's parameters (without the block's norms)."""
    d, h = args.dim, args.n_heads
    q = d * h * args.qk_head_dim if not args.q_lora_rank else (
        d * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * h * args.qk_head_dim)
    kv = d * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
    kv += args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + h * args.v_head_dim * d


def layer_param_counts(args: ModelArgs) -> tuple[int, int, int, int]:
    """Parameters of one block's parts: (attention with both norms, a dense MLP, an MoE layer's shared experts,
    its router gate and routed experts); the last two are 0 for a dense model. An MoE model's ffn_dim is its dense
    blocks' width. The MoE expert-bias buffers are not parameters: param_count adds them."""
    d, hd = args.dim, args.head_dim
    attention = 2 * d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + 2 * d  # q, o; k, v; two norms
    attention += 2 * hd if args.qk_norm else 0
    if isinstance(args, DeepseekV3Args):
        attention = mla_param_count(args) + 2 * d
    n_experts = getattr(args, "n_experts", None)
    if n_experts is None:
        return attention, 3 * d * args.ffn_dim, 0, 0
    h = args.moe_ffn_dim
    routed = n_experts * d + 3 * n_experts * h * d
    if isinstance(args, GptOssArgs):  # q/k/v/o biases and the sinks; the router's and the experts' biases
        attention += args.n_heads * hd + 2 * args.n_kv_heads * hd + d + args.n_heads
        routed += n_experts + n_experts * (2 * h + d)
    return attention, 3 * d * args.ffn_dim, 3 * d * args.n_shared_experts * h, routed


def param_count(args: ModelArgs) -> int:
    """Parameters (and MoE expert biases) of a model with these (checked) ModelArgs / MoEArgs, in closed form:
    no loop over layers, so a crafted n_layers costs nothing to count."""
    attention, dense, shared, routed = layer_param_counts(args)
    d = args.dim
    tied = args.tie_word_embeddings  # one table for the embeddings and the head
    total = (1 if tied else 2) * args.vocab_size * d + d + args.n_layers * attention  # + the final norm
    n_experts = getattr(args, "n_experts", None)
    if n_experts is None:
        return total + args.n_layers * dense
    n_moe = args.n_moe_layers
    total += (args.n_layers - n_moe) * dense + n_moe * (shared + routed + n_experts)
    if isinstance(args, DeepseekV3Args) and args.mtp_layers:
        # Each MTP module: two input norms, the projection of their concatenation, a block like the last one,
        # and the norm before the shared head.
        last = shared + routed + n_experts if args.is_moe_layer(args.n_layers - 1) else dense
        total += args.mtp_layers * (3 * d + 2 * d * d + attention + last)
    return total


def files_fit_problem(args: ModelArgs, *, data_bytes: int, files: str, tied: bool = False,
                      packed: int = 0, packed_per_32: int = 0) -> str | None:
    """What is wrong when the parameters `args` imply, at 2 bytes each at least, exceed the `data_bytes` its weight
    files (`files`) hold, or None: the bound on every size a checkpoint.json or a config.json gives, checked in closed
    form before anything is built (a crafted n_layers of 1e8 would take as long as its layers to build).

    tied: the files hold the embeddings once for the head too (a tied Hugging Face model, whether or not `args`
    ties them: param_count counts a tied table once). packed: how many of the parameters may be stored quantized, in
    `packed_per_32` bytes per 32 (GPT-OSS's MXFP4 experts, 17, trainer/hf/mxfp4.py; DeepSeek-V3's block-FP8 weights, 32,
    trainer/hf/fp8.py).
    """
    n = param_count(args) - (args.vocab_size * args.dim if tied and not args.tie_word_embeddings else 0)
    least = (n - packed) * MIN_BYTES_PER_PARAM + packed * packed_per_32 // 32
    if least <= data_bytes:
        return None
    return (f"the model arguments (dim={args.dim}, n_layers={args.n_layers}, vocab_size={args.vocab_size}) imply "
            f"{n:,} parameters, at least {size_text(least)}, but {files} hold "
            f"{size_text(data_bytes)}; the arguments are not this model's ({EDITED})")


def num_tensors(args: ModelArgs) -> int:
    """Model tensors (state-dict entries) of a model with these args, in closed form."""
    n_experts = getattr(args, "n_experts", None)
    norms = 2 if args.qk_norm else 0  # a tied head is still its own entry
    if n_experts is None:
        return 3 + (9 + norms) * args.n_layers
    n_moe = args.n_moe_layers
    attention = 4  # q, k, v, o
    if isinstance(args, DeepseekV3Args):  # (q, or q_a, its norm and q_b), kv_a, its norm, kv_b, o
        attention = (3 if args.q_lora_rank else 1) + 4
    routed = 5  # the router's gate and expert bias, w1, w2, w3
    if isinstance(args, GptOssArgs):  # + 4 attention biases and the sinks; + the router's bias, w13, b13, b2, w2
        attention, routed = 4 + 4 + 1, 7
    per_moe = attention + 2 + routed + (3 if args.n_shared_experts else 0) + norms
    per_dense = attention + 2 + 3 + norms
    total = 3 + per_dense * (args.n_layers - n_moe) + per_moe * n_moe
    if isinstance(args, DeepseekV3Args):  # each MTP module: 3 norms, eh_proj and a block like the last one
        total += args.mtp_layers * (4 + (per_moe if args.is_moe_layer(args.n_layers - 1) else per_dense))
    return total


def num_params_for(args: ModelArgs) -> tuple[int, int]:
    """(parameters, non-embedding parameters) of a model with these args, as `num_params(model)` counts them
    (param_count less the MoE expert-bias buffers): what the startup log prints, without building a model."""
    total = param_count(args)
    n_experts = getattr(args, "n_experts", None)
    if n_experts is not None:
        n_moe = args.n_moe_layers
        if isinstance(args, DeepseekV3Args) and args.is_moe_layer(args.n_layers - 1):
            n_moe += args.mtp_layers  # MTP blocks like the last one: MoE, with an expert bias each
        total -= n_moe * n_experts
    return total, total - args.vocab_size * args.dim
