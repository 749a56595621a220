"""Blockwise FP8 on the GPU: torchao's kernels against our plain-torch emulation, and a compiled train whose
profile shows FP8 GEMMs. Run on an H100/H200: `pytest -m gpu tests/gpu` (or `bash scripts/gpu_checks.sh blockwise`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.gpu.test_gpu import _profiled_run
from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a CUDA GPU with compute capability >= 9.0 (blockwise FP8 GEMMs)"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_torchao_blockwise_kernels_match_the_emulation() -> None:
    """Forward output and input/weight gradients of torchao's Float8BlockwiseLinear (use_triton=False: Triton
    quantization, cuBLAS F.scaled_mm) against BlockwiseFloat8Linear(emulate=True) on the same bf16 inputs.

    Tolerance: both quantize to the same e4m3 values with the same scales (the same formula in fp32/fp64), so
    they differ only in fp32 summation order and where each scale multiplies (per 128-K partial sum in cuBLAS,
    per element in the emulation), then both round to bf16: about one bf16 ulp on some elements, a norm-relative
    difference of ~1e-3 at most. A wrong tile shape, scale or layout moves the result by the size of the fp8
    error itself (norm-relative ~3e-2 against bf16), so 5e-3 separates the two cases; the fp8 error is asserted
    to be above 1e-2 so the bound is not met by a test that quantizes nothing."""
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear

    torch.manual_seed(0)
    m, k, n = 4096, 2048, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x[:, :128] *= 30  # tiles of very different magnitude, as real activations have
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def run(layer: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            layer.weight.copy_(w)
        xg = x.clone().requires_grad_()
        out = layer(xg)
        out.backward(g)
        return out.detach(), xg.grad, layer.weight.grad

    real = run(Float8BlockwiseLinear(k, n, bias=False, use_triton=False).cuda().to(torch.bfloat16))
    emulated = run(BlockwiseFloat8Linear.from_linear(
        torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), emulate=True))
    ours = run(BlockwiseFloat8Linear.from_linear(
        torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), emulate=False))
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    exact = xr @ wr.T
    exact.backward(g)
    for name, a, b, e in zip(("out", "grad_x", "grad_w"), real, emulated, (exact.detach(), xr.grad, wr.grad)):
        print(f"{name}: real vs emulated {_rel(a, b):.2e}, real vs bf16 {_rel(a, e):.2e}")
        assert _rel(a, b) < 5e-3, name
        assert _rel(a, e) > 1e-2, name  # quantization ran
    for a, b in zip(real, ours):  # our real path is torchao's autograd function, unchanged
        assert torch.equal(a, b)


def test_compiled_blockwise_train_runs_fp8_gemms(tmp_path: Path) -> None:
    summary, stdout = _profiled_run(tmp_path, "fp8", ["--train.compile_model=true", "--float8.recipe=blockwise"])
    print(summary)
    assert "Applied Float8 training: recipe=BLOCKWISE, fsdp_float8_all_gather=False" in stdout
    assert "converted 15/15 Linear layers; excluded: none" in stdout  # 1B shapes: every dim a multiple of 128
    assert "blockwise FP8 (1x128 / 128x128 scales) via torchao's quantization kernels and cuBLAS" in stdout
    assert "FP8 GEMMs ran: yes" in summary and "no FP8 GEMM ran" not in stdout
    share = float(re.search(r"GEMM time .*?, ([\d.]+)% of it in FP8 GEMMs", summary).group(1))
    assert share > 50, summary


def test_weights_per_step_kept_cast_with_the_real_kernels_is_bit_equal_to_casting_per_use() -> None:
    """H100/H200: torchao's kernels (cuBLAS blockwise scaled_mm) through the kept-cast ops give the per-use op's
    output, input gradient and weight gradient bit for bit (the kept cast is the forward's own operand; the dgrad's
    column-major copy of it is the bytes torchao's dgrad cast makes)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = BlockwiseFloat8Linear.from_linear(nn.Linear(512, 384, bias=False), emulate=False).cuda().bfloat16()
        layers.append(layer)
    x = torch.randn(3, 200, 512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(3, 200, 384, device="cuda", dtype=torch.bfloat16)
    layers[1].fp8_weight = layers[1].cast_weight(layers[1].weight.detach())
    results = []
    for layer in layers:
        xg = x.clone().requires_grad_()
        out = layer(xg)
        out.backward(g)
        results.append((out, xg.grad, layer.weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
