"""FP8 dispatch's quantization (trainer/models/moe_dispatch.py) and moe.dispatch_dtype's refusals. The all-to-all itself
(bytes, straight-through backward, ep=2 against bf16 dispatch): tests/distributed/test_moe_dispatch_fp8.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.models.moe_dispatch import (BLOCK, E4M3, dequantize_blocks, fp8_bytes_per_token, pack_rows,
                                         quantize_blocks, unpack_rows)

MOE_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "train" / "debug_moe.toml")
FP8 = ["--train.mixed_precision=fp8", "--float8.emulate=true"]


def _rows() -> torch.Tensor:
    """Rows whose blocks span 12 decades, blocks of one row 1000x apart, zeros, and values deep in a block's range
    (e4m3's subnormals after scaling)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3 * BLOCK, generator=g) * torch.logspace(-8, 4, 64).unsqueeze(1)
    x[:, BLOCK:2 * BLOCK] *= 1e-3
    x[0, :BLOCK] = 0.0
    x[1, 5] = x[1, :BLOCK].abs().max() * 1e-4  # below 2^-6 of the block's amax: a subnormal once scaled
    return x


def test_round_trip_is_within_e4m3_rounding_of_each_block() -> None:
    # A block with amax a is scaled by 2^s <= 448 / a (a power of two, so 2^s > 224 / a). e4m3 keeps 3 mantissa bits:
    # a scaled value in the normal range (>= 2^-6) is rounded to within half an ulp, 2^-4 of itself; below it the
    # step is 2^-9, so within 2^-10 / 2^s < 2^-10 * a / 224 < 2^-17 * a. Each element: max(2^-4 |v|, 2^-17 a).
    x = _rows()
    data, scale = quantize_blocks(x)
    assert data.dtype == E4M3 and scale.shape == (64, 3) and scale.dtype == torch.float32
    y = dequantize_blocks(data, scale, torch.float32)
    amax = x.abs().view(64, 3, BLOCK).amax(-1).repeat_interleave(BLOCK, 1)
    err = (y - x).abs()
    assert (err <= torch.maximum(x.abs() * 2**-4, amax * 2**-17)).all()
    assert torch.equal(y[0, :BLOCK], x[0, :BLOCK])  # an all-zero block stays zero
    # The bound is tight: some normal value is off by more than half of it (3 mantissa bits, not more).
    normal = (x.abs() >= amax * 2**-6) & (amax > 0)
    assert (err[normal] / x.abs()[normal]).max() > 2**-5
    # Scales are powers of two: the bf16 dequantization is the fp32 one, exactly.
    assert torch.equal(dequantize_blocks(data, scale, torch.bfloat16).float(), y)


def test_rows_pack_into_one_byte_per_element_and_four_per_block() -> None:
    x = _rows()
    data, scale = quantize_blocks(x)
    packed = pack_rows(data, scale)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 3 * BLOCK + 4 * 3) == (64, fp8_bytes_per_token(384))
    d2, s2 = unpack_rows(packed, 3 * BLOCK)
    assert torch.equal(d2.view(torch.uint8), data.view(torch.uint8)) and torch.equal(s2, scale)
    assert fp8_bytes_per_token(2048) == 2048 + 64  # moe_16b: 2112 bytes per token instead of bf16's 4096


@pytest.mark.parametrize(
    "world_size, args, message",
    [
        (2, ["--distributed.ep=2", "--moe.dispatch_dtype=fp8", "--train.mixed_precision=bf16"],
         "moe.dispatch_dtype='fp8' needs train.mixed_precision='fp8', but it is 'bf16'"),
        (2, ["--distributed.ep=2", "--moe.dispatch_dtype=e5m2"], "moe.dispatch_dtype='e5m2' is not one of 'bf16', 'fp8'"),
        (1, ["--model.flavor=debug", "--moe.dispatch_dtype=fp8", *FP8],
         "moe.dispatch_dtype='fp8' needs an MoE model, but model.flavor='debug' is dense"),
        (2, ["--moe.dispatch_dtype=fp8", *FP8], "moe.dispatch_dtype='fp8' needs distributed.ep > 1"),
        (2, ["--distributed.ep=2", "--moe.dispatch_dtype=fp8", "--model.dim=192", "--model.n_heads=4", *FP8],
         "moe.dispatch_dtype='fp8' needs model.dim a multiple of 128 (one scale per 1x128 block of each token row), "
         "but it is 192"),
    ],
)
def test_bad_dispatch_configs_are_one_line_naming_the_key(world_size: int, args: list[str], message: str) -> None:
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, *args]), world_size=world_size)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_fp8_dispatch_is_handed_to_the_build() -> None:
    from trainer.config import load_job_config
    from trainer.validate import validate_job

    job = validate_job(load_job_config(["--config", MOE_CONFIG, "--distributed.ep=2", "--moe.dispatch_dtype=fp8", *FP8]),
                       world_size=2)
    assert job.build.moe_dispatch_dtype == "fp8"
