"""Precision per block and per GEMM role of an fp8 run: float8.bf16_first_blocks / bf16_last_blocks (whole
transformer blocks kept bf16) and float8.forward / float8.backward (which GEMMs of a converted Linear, and of the
FP8 experts, run in FP8), checked and resolved once here; `Float8Options` carries the result down.

A combination that means nothing is one ConfigError line naming the keys: both roles bf16 (no FP8 GEMM left),
delayed scaling or FP8 saved inputs with a bf16 role (our tensorwise linear keeps histories and saved casts for
both directions), FP8 token dispatch into bf16 forward GEMMs, and an FP8 all-gather with a bf16 role (a float8-gathered weight has no bf16 copy to run the
bf16 GEMMs from; 'auto' turns it off, `all_gather_with_roles`).
"""

from __future__ import annotations

import logging

from trainer.config import JobConfig
from trainer.errors import ConfigError

logger = logging.getLogger(__name__)


def check_float8_roles(cfg: JobConfig) -> None:
    """float8.forward / float8.backward against the rest of [float8]: one line naming the keys where they clash."""
    f8 = cfg.float8
    roles = f"float8.forward='{f8.forward}', float8.backward='{f8.backward}'"
    if f8.forward == "bf16" and f8.backward == "bf16":
        raise ConfigError(f"{roles} leaves no GEMM in FP8: set train.mixed_precision='bf16' instead (or one role "
                          "'fp8')")
    if "bf16" not in (f8.forward, f8.backward):
        return
    if f8.scaling == "delayed":
        raise ConfigError(f"float8.scaling='delayed' keeps amax histories for the FP8 casts of both directions; "
                          f"with {roles} set float8.scaling='dynamic' (or both roles 'fp8')")
    if f8.save_fp8_activations:
        raise ConfigError(f"float8.save_fp8_activations=true saves the forward's FP8 input for an FP8 weight "
                          f"gradient; with {roles} set it false (or both roles 'fp8')")
    if f8.forward == "bf16" and cfg.moe.dispatch_dtype == "fp8":
        raise ConfigError(f"moe.dispatch_dtype='fp8' sends FP8-rounded tokens to FP8 expert GEMMs; with {roles} the "
                          "forward GEMMs are bf16: set moe.dispatch_dtype='bf16' (or float8.forward='fp8')")
    if f8.enable_fsdp_float8_all_gather is True:
        raise ConfigError(f"float8.enable_fsdp_float8_all_gather=true gathers float8 weights, which have no bf16 "
                          f"copy for the bf16 GEMMs of {roles}: set it 'auto' (off here) or false")


def all_gather_with_roles(cfg: JobConfig, all_gather: bool) -> bool:
    """float8.enable_fsdp_float8_all_gather='auto' resolved: off where a role is bf16 (said in one line)."""
    f8 = cfg.float8
    if all_gather and "bf16" in (f8.forward, f8.backward):
        logger.info("float8.enable_fsdp_float8_all_gather='auto': off, as float8.forward='%s', float8.backward='%s' "
                    "run bf16 GEMMs from the bf16 weights", f8.forward, f8.backward)
        return False
    return all_gather


def resolve_bf16_blocks(cfg: JobConfig, n_layers: int) -> dict[int, str]:
    """The global index of every block float8.bf16_first_blocks / bf16_last_blocks keep bf16 -> its reason."""
    first, last = cfg.float8.bf16_first_blocks, cfg.float8.bf16_last_blocks
    for key, n in (("bf16_first_blocks", first), ("bf16_last_blocks", last)):
        if n < 0:
            raise ConfigError(f"float8.{key}={n} must be >= 0 (0 = no block kept bf16)")
    if first + last > n_layers:
        raise ConfigError(f"float8.bf16_first_blocks={first} + float8.bf16_last_blocks={last} name more blocks than "
                          f"the model's {n_layers}: lower them (or set train.mixed_precision='bf16')")
    blocks = {i: f"float8.bf16_first_blocks={first}" for i in range(first)}
    return blocks | {i: f"float8.bf16_last_blocks={last}" for i in range(n_layers - last, n_layers)}
