"""The Triton AdamW kernel (trainer/optim/kernel.py) compiled for the GPU: the comparisons of
tests/unit/test_optim_kernel.py (which runs it in Triton's CPU interpreter) on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_optim_kernel import bf16_runs, check_fp32_pair, check_random_bits, check_within_an_ulp, fp32_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_fp32_kernel_equals_torchs_fused_adamw_on_the_gpu() -> None:
    check_fp32_pair(*fp32_pair("cuda"))


@pytest.mark.parametrize("kind", ["stochastic", "kahan"])
def test_bf16_kernel_rounds_as_the_eager_update_on_the_gpu(kind: str) -> None:
    check_random_bits(*bf16_runs(kind, True, beta1=0.5, device="cuda"))
    check_within_an_ulp(*bf16_runs(kind, True, device="cuda"), kahan=kind == "kahan")
