"""Can real FP8 kernels run here, and if not, why: the one probe, and the one loud answer when they cannot.

The validation pass asks it under float8.require (before any process group exists, on `local_device()`);
the conversions ask it for the device they build on, and either convert or say loudly what runs instead.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def local_device() -> torch.device:
    """The device this process will train on, known before the process group: cuda:LOCAL_RANK, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def fp8_supported(device: torch.device, recipe: str = "tensorwise") -> tuple[bool, str]:
    """Whether real FP8 matmuls of `recipe` can run on this device, and what runs (or why they cannot)."""
    blockwise = recipe == "blockwise"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if (major, minor) < (8, 9):
            return False, f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores (needs >= 8.9)"
        if blockwise and major < 9:
            return False, (f"{name} (compute capability {major}.{minor}) has no blockwise FP8 GEMM (torchao's "
                           "blockwise kernels need >= 9.0)")
        if blockwise:
            return True, (f"{name} (compute capability {major}.{minor}): blockwise FP8 (1x128 / 128x128 scales) "
                          "via torchao's quantization kernels and cuBLAS F.scaled_mm")
        return True, f"{name} (compute capability {major}.{minor}): FP8 tensor cores via torch._scaled_mm"
    if device.type == "cpu" and blockwise:
        return False, ("CPU has no blockwise FP8 kernels (torchao's are Triton + cuBLAS; float8.emulate=true "
                       "emulates them)")
    if device.type == "cpu":
        return True, "CPU: real torch._scaled_mm path (aten's CPU kernel; for correctness, not speed)"
    return False, f"device type {device.type!r} has no known FP8 matmul"


def fp8_grouped_supported(device: torch.device) -> tuple[bool, str]:
    """Whether torch._scaled_grouped_mm (rowwise e4m3, the routed experts' GEMM) runs on this device, and what runs."""
    if device.type != "cuda":
        return False, f"torch._scaled_grouped_mm has no {device.type.upper()} kernel"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) != (9, 0):
        # torch's rowwise FP8 grouped GEMM is a CUTLASS sm90 kernel; other GPUs get MXFP8 or nothing.
        return False, f"{name} (compute capability {major}.{minor}): torch's rowwise FP8 grouped GEMM needs sm90"
    return True, f"{name}: torch._scaled_grouped_mm"


def refuse_or_warn(what: str, *, require: bool, setting: str, headline: str, instead: str) -> None:
    """FP8 kernels cannot run here (`what` says why): under float8.require stop, otherwise a banner no one misses.

    `setting` is what asked for FP8 (e.g. "train.mixed_precision='fp8'"), `headline` the banner's capitals,
    `instead` the sentence saying what trains in their place.
    """
    if require:
        raise ValueError(f"{setting} but {what}; float8.require=true, so stopping")
    banner = "!" * 100
    logger.warning("\n%s\n%s: %s.\n%s Set float8.require=true to fail instead.\n%s",
                   banner, headline, what, instead, banner)
