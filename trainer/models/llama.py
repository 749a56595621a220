"""Llama 3 dense decoder.

Module names are a contract: the FP8 filter, tensor parallel plan (`tp_plan`), checkpoint
export and tests address modules as `tok_embeddings`,
`layers.{i}.attention.{q,k,v,o}_proj`, `layers.{i}.mlp.{gate,up,down}_proj`,
`layers.{i}.attention_norm`, `layers.{i}.mlp_norm`, `norm`, `output_head.proj`.
The shared pieces (RoPE, norms, attention, MLP, head, init) live in
`trainer.models.layers` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import replace

from trainer.models.counts import layer_param_counts
from trainer.models.activations import ActivationPolicy, block_activation_bytes
from trainer.models.layers import (  # noqa: F401  (re-exported: `from trainer.models.llama import ...`)
    MLP,
    Attention,
    Decoder,
    ModelArgs,
    OutputHead,
    RMSNorm,
    RopeScaling,
    TPPlan,
    TransformerBlock,
    _fill,
    apply_rope,
    block_tp_plan,
    clean_fqn,
    decoder_tp_plan,
    mlp_tp_plan,
    num_params,
    rope_cache,
    rope_inv_freq,
)


# Published Llama 3 / 3.1 / 3.2 shapes; `debug` is ours and trains on a CPU in seconds. No flavor ties its output
# head to the embeddings: `1b` and `3b` have Llama 3.2's layers with an untied head (1b: 1.50B parameters, the
# published tied model 1.24B; model.tie_word_embeddings=true ties them). The benchmarks were measured so.
FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, rope_theta=10000.0),
    "1b": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.5,
        rope_scaling=RopeScaling(factor=32.0),
    ),
    "3b": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.0,
        rope_scaling=RopeScaling(factor=32.0),
    ),
    "8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_scaling=RopeScaling(factor=8.0),
    ),
    "70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.3, multiple_of=4096,
        rope_scaling=RopeScaling(factor=8.0),
    ),
    "405b": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.2,
        multiple_of=4096, rope_scaling=RopeScaling(factor=8.0),
    ),
}


def model_args_for(flavor: str, *, vocab_size: int = 0, n_layers: int = 0, max_seq_len: int = 0) -> ModelArgs:
    """A flavor's shapes with optional overrides (0 keeps the flavor's value)."""
    if flavor not in FLAVORS:
        raise ValueError(f"model.flavor={flavor!r} is not one of {', '.join(repr(f) for f in FLAVORS)}")
    args = FLAVORS[flavor]
    overrides = {"vocab_size": vocab_size, "n_layers": n_layers}
    args = replace(args, **{k: v for k, v in overrides.items() if v})
    if max_seq_len:
        args = replace(args, max_seq_len=max(max_seq_len, args.max_seq_len))
    return args


class Llama(Decoder):
    def __init__(self, args: ModelArgs):
        super().__init__(args, [TransformerBlock(args) for _ in range(args.n_layers)])


def tp_plan(model: Llama, *, loss_parallel: bool) -> TPPlan:
    """Megatron-style tensor parallel on every block (column-parallel q/k/v and gate/up, row-parallel o/down),
    sequence-parallel norms, vocabulary-parallel head with loss_parallel."""
    block = block_tp_plan("mlp", mlp_tp_plan(), qk_norm=model.args.qk_norm)
    return TPPlan(top=decoder_tp_plan(loss_parallel=loss_parallel), blocks={name: block for name in model.layers})


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_non-embedding + attention (12 * L * H * Dh * S).

    N counts every matmul weight the token passes through (blocks and output head);
    the embedding lookup is no matmul. The attention term counts QK^T and AV for
    forward and backward without the causal halving, as in the PaLM/Megatron MFU.
    """
    attn = args.dim * args.head_dim * (args.n_heads + 2 * args.n_kv_heads) + args.n_heads * args.head_dim * args.dim
    mlp = 3 * args.dim * args.ffn_dim
    norms = 2 * args.dim
    n = args.n_layers * (attn + mlp + norms) + args.dim + args.dim * args.vocab_size
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def block_runs(args: ModelArgs) -> tuple[range, ...]:
    """The blocks in runs of alike ones: every block is alike."""
    return (range(args.n_layers),)


def block_params(args: ModelArgs, i: int) -> tuple[int, int]:
    """(parameters of block i, of which routed experts': none)."""
    attention, mlp, _, _ = layer_param_counts(args)
    return attention + mlp, 0


def activation_bytes(args: ModelArgs, i: int, policy: ActivationPolicy) -> tuple[int, int]:
    """(saved, backward) bytes per token of block i (trainer.models.activations): attention and the MLP."""
    return block_activation_bytes(args, policy, ffn_dim=args.ffn_dim, fp8_mlp=policy.fp8_mlp)
