"""build_parallel_model: the order of these calls is the architecture.

    CP / TP / EP  ->  FP8  ->  activation checkpointing  ->  compile  ->  FSDP2

The loss (final norm, output head, cross-entropy; chunked or not) is built beside the model by
`trainer.loss.build_loss_fn`, the same for a whole model and a pipeline's last stage.

Each stage takes a resolved option object (made once, from the validated config, by
`trainer.validate`), never the JobConfig, and asks `ParallelDims` for its mesh by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from trainer.models.layers import AttentionCore
from trainer.parallel.activation_checkpoint import apply_ac
from trainer.parallel.compile import apply_compile
from trainer.parallel.context_parallel import ContextParallel, apply_cp
from trainer.parallel.expert_parallel import apply_ep
from trainer.parallel.float8 import Float8Options, Float8Report, apply_float8
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.tensor_parallel import apply_tp

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ACOptions:
    mode: Literal["none", "selective", "full"]
    selective_every: int


@dataclass(frozen=True)
class FSDPOptions:
    param_dtype: torch.dtype | None
    """Dtype weights are all-gathered and computed in; None keeps the master dtype (fp32 runs)."""
    reduce_dtype: torch.dtype
    """Dtype gradients are reduce-scattered and accumulated in (fp32 where they are summed; else the compute dtype).
    A float8 dtype (distributed.reduce_dtype='fp8'): exchanged in float8, written and accumulated in master_dtype."""
    master_dtype: torch.dtype
    reshard_after_forward: bool
    reduces: bool = True
    """Gradients are summed: over ranks (dp, cp, tp) or microbatches (accumulation, pp). False: one of each."""
    experts_outside: bool = False
    """The routed experts are no FSDP2 unit (trainer.validate.resolve.experts_outside_fsdp: ep over the whole shard
    group, master weights in the compute dtype); they divide their own gradients (trainer.parallel.fsdp)."""


@dataclass(frozen=True)
class BuildOptions:
    """Everything build_parallel_model (and the loss beside it) needs, resolved from the config by trainer.validate."""

    float8: Float8Options | None  # None: no FP8 conversion
    ac: ACOptions
    compile: bool
    fsdp: FSDPOptions
    loss_parallel: bool
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the output head and loss (trainer.loss.LossFn); 0 = all at once."""
    seq_len: int = 0
    """Tokens per sequence (train.seq_len): the chunk length under context parallelism."""
    document_eos: int | None = None
    """data.document_masking: the EOS id that ends each document of a packed row (trainer.models.documents)."""
    compile_loss: bool = False
    """Compile the final norm, output head and loss (trainer.loss.LossFn) with the blocks; not under TP, whose
    vocabulary-parallel loss runs eagerly, nor with a tied head (its FSDP2 unit's hooks break the graph)."""
    attention_backends: tuple[str, ...] = ()
    """SDPA's kernels in order of preference (SDPBackend names: "CUDNN_ATTENTION", ...); () = torch's choice."""
    moe_dispatch_dtype: str = "bf16"
    """moe.dispatch_dtype: what token rows cross the expert-parallel dispatch as, "bf16" or "fp8" (ep > 1 only)."""
    moe_padded_dispatch: bool = False
    """moe.dispatch='padded' (or 'auto' choosing it): the expert-parallel all-to-alls move fixed slots of rows, no
    host sync (ep > 1 only)."""
    moe_dispatch_note: str = ""
    """moe.dispatch='auto' at ep > 1: which all-to-all it chose and why, for the expert-parallel startup line."""
    moe_overlap_all_to_all: bool = False
    """moe.overlap_all_to_all under ep > 1 and compile: the MoE blocks' graphs overlap the all-to-alls with compute
    that does not need them (trainer.parallel.compile.OVERLAP_INDUCTOR_OPTIONS)."""


@dataclass(frozen=True)
class BuildResult:
    """What build_parallel_model made besides the model: the FP8 report and the context-parallel layout."""

    float8: Float8Report | None
    """None when the run is not fp8."""
    cp: ContextParallel | None
    """This rank's chunks of every sequence (the step cuts each batch to them); None without context parallelism."""


def apply_attention_backends(model: nn.Module, names: tuple[str, ...]) -> str:
    """Every attention's SDPA kernels, in order of preference (train.attention_backend)."""
    backends = [getattr(SDPBackend, name) for name in names]
    for module in model.modules():
        if isinstance(module, AttentionCore):
            module.sdpa_backends = backends
    return f"attention: scaled_dot_product_attention with {' > '.join(n.split('_')[0].lower() for n in names)}"


def build_parallel_model(
    model: nn.Module, parallel_dims: ParallelDims, *, options: BuildOptions, device: torch.device
) -> BuildResult:
    """Apply CP -> TP -> EP -> FP8 -> AC -> compile -> FSDP2 to a meta-device model, in place.

    The model stays on the meta device; the caller materializes it (`to_empty`) and calls `init_weights`
    (trainer.parallel.build does both), so no rank ever holds more than its shards.
    """
    pd, o = parallel_dims, options

    # CP first: it changes what attention and RoPE compute, not any weight.
    cp = None
    if pd.cp > 1:
        cp = ContextParallel.of_mesh(pd.mesh("cp"))
        logger.info(apply_cp(model, cp, seq_len=o.seq_len))

    elif o.attention_backends:
        logger.info(apply_attention_backends(model, o.attention_backends))

    # TP next: it replaces weights by DTensors that every later stage must see.
    if pd.tp > 1:
        logger.info(apply_tp(model, pd.mesh("tp"), loss_parallel=o.loss_parallel))

    # EP next: routed experts become DTensors over the ep axis, which FSDP2 shards further.
    if pd.ep > 1:
        logger.info(apply_ep(model, pd.mesh("ep"), dispatch_dtype=o.moe_dispatch_dtype, padded=o.moe_padded_dispatch,
                             note=o.moe_dispatch_note))

    # FP8 swaps nn.Linear classes and the experts' kernels, so it comes before AC/compile/FSDP wrap them.
    report = None
    if o.float8 is not None:
        report = apply_float8(model, o.float8, device=device)
        # Only on a GPU: there compile fuses the casts into the matmuls' neighbours. On a CPU fp8 is for tests
        # (aten's _scaled_mm), and compiling it costs minutes of inductor codegen for nothing faster.
        if report.enabled and not o.compile and device.type == "cuda":
            logger.warning(
                "FP8 without train.compile_model=true: the eager float8 casts usually make it slower than "
                "bf16; set --train.compile_model=true"
            )

    # AC wraps blocks before compile so the recompute is traced into the compiled graph.
    logger.info(apply_ac(model, mode=o.ac.mode, selective_every=o.ac.selective_every))

    # Compile before FSDP so FSDP's hooks stay outside the compiled graphs.
    if o.compile:
        logger.info(apply_compile(model, context_parallel=cp is not None, overlap_all_to_all=o.moe_overlap_all_to_all))

    # FSDP2 last: it shards whatever the model has become (DTensors from TP, Float8Linear weights).
    if o.fsdp.master_dtype != torch.float32:
        cast_parameters(model, o.fsdp.master_dtype)
    logger.info(
        apply_fsdp(
            model, pd.mesh("fsdp"), param_dtype=o.fsdp.param_dtype, reduce_dtype=o.fsdp.reduce_dtype,
            reshard_after_forward=o.fsdp.reshard_after_forward,
            expert_mesh=pd.mesh("expert_fsdp") if pd.ep > 1 or pd.tp > 1 else None, routers_with_experts=pd.tp > 1,
            experts_outside=o.fsdp.experts_outside,
        )
    )
    return BuildResult(float8=report, cp=cp)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Master weights in `dtype`, in place; buffers keep theirs.

    Not `model.to(dtype)`, which casts floating buffers too: the MoE expert biases and token
    counts must stay fp32 (a 1e-3 bias step is lost in bf16 once |bias| >= 0.5, and counts
    above 256 are inexact there).
    """
    cast: dict[int, nn.Parameter] = {}  # a Parameter two modules share (a tied head) stays one
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                module.register_parameter(name, cast[id(param)])
