"""MXFP4, the format gpt-oss's released folders store their experts in (`quantization_config.quant_method` "mxfp4"),
dequantized on read exactly as transformers does without its triton kernels (integrations/mxfp4.py,
`convert_moe_packed_tensors`).

A tensor `X` of shape [E, C, R] (GptOssExperts' gate_up_proj [E, d, 2h], down_proj [E, h, d]) is stored as
`X_blocks`, uint8 [E, R, C / 32, 16], and `X_scales`, uint8 [E, R, C / 32]: its transpose [E, R, C], each row cut
into blocks of 32 values along C. A byte holds two e2m1 values, the low nibble the first (even index), the high
nibble the second; a nibble is sign (bit 3), then a 2-bit exponent and 1-bit mantissa: `FP4_VALUES`. A scale byte is
an e8m0 exponent with a bias of 127: value = FP4_VALUES[nibble] x 2^(scale - 127). Every such value is exact in
bfloat16 (a 1-bit mantissa, fp32's exponent range), which the dequantized tensor is.

A leaf: torch only (trainer/hf/folder.py reads the two tensors and calls `dequantize`).
"""

from __future__ import annotations

import torch

MXFP4 = "MXFP4"
"""The dtype name a folder's merged header gets (trainer.hf.folder.Header): two uint8 tensors read as one."""
BLOCKS, SCALES = "_blocks", "_scales"
# e2m1: sign, exponent (bias 1), mantissa; transformers' FP4_VALUES, in nibble order.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
# As trainer.hf.PACKED_FORMATS reads a format: its headers' dtype, 32 parameters' bytes on disk, what its log says.
DTYPE, BYTES_PER_32, WHICH, ROUNDING = MXFP4, 17, "the experts", "exact"


def packed_problem(blocks: tuple[str, tuple[int, ...]], scales: tuple[str, tuple[int, ...]]) -> str | None:
    """What is wrong with a pair's (dtype, shape) of safetensors headers as MXFP4 experts, or None."""
    (b_dtype, b_shape), (s_dtype, s_shape) = blocks, scales
    if (b_dtype, s_dtype) != ("U8", "U8"):
        return f"stored as {b_dtype} and {s_dtype}, not the uint8 of MXFP4 blocks and scales"
    if len(b_shape) != 4 or tuple(b_shape[:-1]) != tuple(s_shape) or b_shape[-1] < 1:
        return (f"blocks of shape {list(b_shape)} and scales of shape {list(s_shape)}: MXFP4 experts are "
                "[experts, rows, groups, bytes] and [experts, rows, groups]")
    return None


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[E, R, G, B] blocks -> the tensor's [E, G x 2B, R]."""
    e, r, g, b = blocks_shape
    return (e, g * 2 * b, r)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 blocks [E, R, G, B] and scales [E, R, G] -> [E, G x 2B, R] of `dtype` (module docstring). One expert at
    a time: the nibble indices of a whole 120B tensor would take many times its size."""
    e, r, g, b = blocks.shape
    assert tuple(scales.shape) == (e, r, g) and blocks.dtype == scales.dtype == torch.uint8
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(e, r, g, 2 * b, dtype=dtype)
    for i in range(e):
        packed = blocks[i].long()
        values = torch.stack([lut[packed & 0x0F], lut[packed >> 4]], dim=-1).reshape(r, g, 2 * b)
        # fp32 as transformers computes it (ldexp: value x 2^exp, exact; a scale of 255 is inf there too), then cast:
        # the result is exact in bfloat16.
        out[i] = torch.ldexp(values, (scales[i].int() - SCALE_BIAS).unsqueeze(-1)).to(dtype)
    return out.reshape(e, r, g * 2 * b).transpose(1, 2).contiguous()
