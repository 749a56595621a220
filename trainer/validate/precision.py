"""train.mixed_precision = "auto" (Axolotl's `bf16: auto`): the precision this job's GPUs run best, resolved first.

    fp8    GPUs with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper and later; >= 9.0 for the blockwise
           recipe), unless tensor parallelism is on (FP8 + TP is not supported: bf16)
    bf16   compute capability >= 8.0 (Ampere)
    fp16   older GPUs (with fp16's loss scaling)
    fp32   no GPU: reduced precision is emulated and slow on a CPU

The job's config is replaced by one with that precision (checked again as any config is), and one startup
line says what was chosen and why. A dry run plans for GPUs with FP8 tensor cores.
"""

from __future__ import annotations

import dataclasses
import logging

from trainer.config import JobConfig
from trainer.validate.memory import Target

logger = logging.getLogger(__name__)


def resolve_auto_precision(cfg: JobConfig, target: Target) -> JobConfig:
    """`cfg` with train.mixed_precision='auto' replaced by this target's choice (else `cfg` itself)."""
    if cfg.train.mixed_precision != "auto" or cfg.train.precision_schedule:  # a schedule names its precisions
        return cfg
    precision, why = choose_precision(cfg, target)
    logger.info("train.mixed_precision='auto': %s (%s)", precision, why)
    if cfg.validation.enable and cfg.validation.mixed_precision == "bf16" and precision in ("fp32", "fp16"):
        logger.warning("validation.mixed_precision='bf16' evaluates an fp8 run's matmuls in bf16; this %s run "
                       "evaluates in %s", precision, precision)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mixed_precision=precision))


def choose_precision(cfg: JobConfig, target: Target) -> tuple[str, str]:
    """(precision, why) for `cfg` on `target`."""
    if target.device_type != "cuda":
        return "fp32", "no GPU: on a CPU reduced precision is emulated and slower than fp32"
    if target.capability is None:  # a dry run's GPUs
        fp8_ok, where = True, "the planned GPUs, which have FP8 tensor cores"
    else:
        major, minor = target.capability
        needed = (9, 0) if cfg.float8.recipe == "blockwise" else (8, 9)
        fp8_ok, where = (major, minor) >= needed, f"{target.name}: compute capability {major}.{minor}"
        if not fp8_ok and (major, minor) >= (8, 0):
            return "bf16", f"{where}, bf16 tensor cores but no FP8 ones for float8.recipe='{cfg.float8.recipe}'"
        if not fp8_ok:
            return "fp16", f"{where}: no bf16 tensor cores (fp16 with loss scaling)"
    if cfg.distributed.tp > 1:
        return "bf16", f"{where}; FP8 with distributed.tp={cfg.distributed.tp} is not supported yet"
    return "fp8", f"{where}; float8.recipe='{cfg.float8.recipe}'"
