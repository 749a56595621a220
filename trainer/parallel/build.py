"""build_parallel_model: the order of these calls is the architecture."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.config import JobConfig
from trainer.parallel.activation_checkpoint import apply_ac
from trainer.parallel.compile import apply_compile
from trainer.parallel.float8 import Float8Report, apply_float8
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.parallel_dims import DP_REPLICATE, DP_SHARD, TP, ParallelDims
from trainer.parallel.tensor_parallel import apply_tp

logger = logging.getLogger(__name__)

_COMPUTE_DTYPE = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


@dataclass
class ParallelModel:
    model: nn.Module
    float8: Float8Report | None
    applied: list[str]


def build_parallel_model(
    model: nn.Module, cfg: JobConfig, parallel_dims: ParallelDims, mesh: DeviceMesh, device: torch.device
) -> ParallelModel:
    """Apply TP -> FP8 -> AC -> compile -> FSDP2 to a meta-device model, in place.

    The model stays on the meta device; the caller materializes it (`to_empty`)
    and calls `init_weights`, so no rank ever holds more than its shards.
    """
    t, d = cfg.train, cfg.distributed
    applied: list[str] = []

    def log(line: str) -> None:
        applied.append(line)
        logger.info(line)

    # TP first: it replaces weights by DTensors that every later step must see.
    if parallel_dims.tp > 1:
        apply_tp(model, mesh[TP], loss_parallel=d.loss_parallel)
        log(f"tensor parallel: tp={parallel_dims.tp}, sequence parallel norms, loss_parallel={d.loss_parallel}")

    # EP would go here (MoE experts); dense Llama has none.

    # FP8 swaps nn.Linear classes, so it must come before AC/compile/FSDP wrap them.
    report = None
    if t.mixed_precision == "fp8":
        f8 = cfg.float8
        report = apply_float8(
            model,
            recipe=f8.recipe,
            enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
            exclude_fqns=f8.exclude_fqns,
            emulate=f8.emulate,
            require=f8.require,
            device=device,
        )
        applied.extend(report.lines() if report.enabled else ["float8: not applied (bf16 fallback)"])
        if report.enabled and not t.compile_model:
            logger.warning(
                "FP8 without train.compile_model=true: the eager float8 casts usually make it slower than "
                "bf16; set --train.compile_model=true"
            )

    # AC wraps blocks before compile so the recompute is traced into the compiled graph.
    log(apply_ac(model, mode=t.activation_checkpointing, selective_every=t.selective_ac_every))

    # Compile before FSDP so FSDP's hooks stay outside the compiled graphs.
    if t.compile_model:
        log(apply_compile(model, compile_head=parallel_dims.tp == 1))

    # FSDP2 last: it shards whatever the model has become (DTensors from TP, Float8Linear weights).
    dp_mesh = mesh[(DP_REPLICATE, DP_SHARD)] if parallel_dims.dp_replicate > 1 else mesh[DP_SHARD]
    if d.master_dtype == "bf16":
        model.to(torch.bfloat16)
    # Resharding frees the gathered copy between forward and backward; with one rank
    # per shard group it frees nothing but still costs a second gather in backward.
    reshard = d.reshard_after_forward == "always" or (
        d.reshard_after_forward == "default" and parallel_dims.dp_shard > 1
    )
    log(
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=_COMPUTE_DTYPE[t.mixed_precision],
            reduce_dtype=torch.float32,
            reshard_after_forward=reshard,
        )
    )
    return ParallelModel(model=model, float8=report, applied=applied)
