"""Block FP8, the format DeepSeek-V3/R1's released folders store their linear weights in
(`quantization_config.quant_method` "fp8", `fmt` "e4m3", `weight_block_size` [128, 128]), dequantized on read as
transformers (integrations/finegrained_fp8.py, `Fp8Dequantize`) and DeepSeek's own `fp8_cast_bf16.py` do.

A weight `X` [R, C] is stored as `X` in float8_e4m3fn and `X_scale_inv` (`X` = `....weight`, so
`....weight_scale_inv`), float32 [ceil(R / bm), ceil(C / bn)] for a block size [bm, bn]: value = X[r, c] x
scale_inv[r // bm, c // bn], the last row and column of blocks cut short where bm or bn does not divide R or C. The
product is taken in float32 (exact for each fp8 value; one rounding of the product, as theirs), then cast to bfloat16
(the released "bf16" weights are this cast too). Which weights are quantized is the folder's: every tensor with its
`_scale_inv` (DeepSeek-V3: the attention, dense, shared and routed expert projections; the embeddings, norms, the
router and lm_head are bf16).

A leaf: torch only (trainer/hf/folder.py reads the two tensors and calls `dequantize`).
"""

from __future__ import annotations

import torch

FP8 = "FP8"
"""The dtype name a folder's merged header gets (trainer.hf.folder.Header): a weight and its scales read as one."""
SCALE_INV = "_scale_inv"
WEIGHT_DTYPE, SCALE_DTYPES = "F8_E4M3", ("F32", "BF16")
# As trainer.hf.PACKED_FORMATS reads a format: its headers' dtype, 32 parameters' bytes on disk at the least (their
# scales aside), what its log says.
DTYPE, BYTES_PER_32 = FP8, 32
WHICH, ROUNDING = "the linear weights", "each value times its block's scale in float32, rounded once to bfloat16"
# What the float32 products of one read take at a time (a 7168 x 18432 projection is 0.5 GiB in float32).
_CHUNK_VALUES = 2**24
# transformers' FineGrainedFP8Config defaults, where a quantization_config leaves a key out.
_DEFAULTS = {"fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "scale_fmt": "float",
             "expert_dtype": "fp8"}
_READ = {"fmt": ("e4m3",), "activation_scheme": ("dynamic",), "scale_fmt": ("float",), "expert_dtype": ("fp8",)}
_WHY = {"fmt": "float8_e4m3fn weights, DeepSeek-V3's", "activation_scheme": "its folders hold weights and their "
        "scales only", "scale_fmt": "float32 scales", "expert_dtype": "FP8 experts"}


def config_problem(quant: dict) -> str | None:
    """What this reader cannot take in an "fp8" quantization_config (a one-line message naming the key), or None."""
    for key, read in _READ.items():
        if (value := quant.get(key, _DEFAULTS[key])) not in read:
            return (f"quantization_config.{key}={value!r}: this trainer reads block FP8 with {key} "
                    f"{' or '.join(map(repr, read))} only ({_WHY[key]})")
    block = quant.get("weight_block_size", _DEFAULTS["weight_block_size"])
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 2**20 for b in block)):
        return (f"quantization_config.weight_block_size={block!r}: not two positive integers [rows, columns] "
                "(DeepSeek-V3's [128, 128]); per-tensor FP8 (null) is not read")
    return None


def block_size(quant: dict) -> tuple[int, int]:
    """[rows, columns] of a block of a quantization_config that `config_problem` passed."""
    bm, bn = quant.get("weight_block_size", _DEFAULTS["weight_block_size"])
    return bm, bn


def scales_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale_inv grid of a [R, C] weight: one scale per block, the last blocks partial."""
    (r, c), (bm, bn) = shape, block
    return -(-r // bm), -(-c // bn)


def pair_problem(weight: tuple[str, tuple[int, ...]], scales: tuple[str, tuple[int, ...]],
                 block: tuple[int, int]) -> str | None:
    """What is wrong with a (weight, scale_inv) pair's (dtype, shape) of safetensors headers as block FP8, or None."""
    (w_dtype, w_shape), (s_dtype, s_shape) = weight, scales
    if w_dtype != WEIGHT_DTYPE or s_dtype not in SCALE_DTYPES:
        return (f"stored as {w_dtype} with scales of {s_dtype}: a block-FP8 weight is {WEIGHT_DTYPE} "
                f"(float8_e4m3fn) with {' or '.join(SCALE_DTYPES)} scales")
    if len(w_shape) != 2 or tuple(s_shape) != scales_shape(w_shape, block):
        want = list(scales_shape(w_shape, block)) if len(w_shape) == 2 else "a 2-D weight"
        return (f"scales of shape {list(s_shape)} for a weight of shape {list(w_shape)}: weight_block_size "
                f"{list(block)} gives {want} (one scale per block, the last ones partial)")
    return None


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float8_e4m3fn [R, C] and its scale_inv [ceil(R / bm), ceil(C / bn)] -> [R, C] of `dtype` (module docstring).
    A slice of rows of blocks at a time: the float32 products of a whole projection would take twice its bf16."""
    (r, c), (bm, bn) = weight.shape, block
    assert weight.dtype == torch.float8_e4m3fn and tuple(scale_inv.shape) == scales_shape((r, c), block)
    # Each scale over its block's columns: [R / bm, C] (1 / bm of the weight's values).
    columns = scale_inv.float().repeat_interleave(bn, dim=1)[:, :c]
    out = torch.empty(r, c, dtype=dtype)
    step = bm * max(1, _CHUNK_VALUES // max(1, bm * c))
    for start in range(0, r, step):
        part = weight[start:start + step].float()
        scale = columns[start // bm:(start + part.shape[0] + bm - 1) // bm].repeat_interleave(bm, dim=0)
        out[start:start + part.shape[0]] = (part * scale[:part.shape[0]]).to(dtype)
    return out
