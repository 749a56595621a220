"""float8.forward / float8.backward on the GPU's real FP8 GEMMs (cuBLAS _scaled_mm, torchao's blockwise kernels),
eager and compiled: a bf16 role's GEMMs are a bf16 nn.Linear's, the other role's the all-FP8 Linear's (written on a
CPU machine, not run on a GPU yet). The same assertions bit for bit on CPU: tests/unit/test_float8_roles.py. Run on
an H100/H200: `pytest -m gpu tests/gpu` (or `bash scripts/gpu_checks.sh tests`); speed and accuracy:
`gpu_checks.sh fp8roles`, parity1b's legs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.parallel.float8 import Float8Options, apply_float8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a CUDA GPU with compute capability >= 9.0 (every FP8 recipe)"),
]
CUDA = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(recipe: str, forward: str, backward: str, x: torch.Tensor, grad: torch.Tensor, *, compiled: bool):
    torch.manual_seed(0)
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.up_proj = nn.Linear(x.shape[-1], grad.shape[-1], bias=False, device=CUDA, dtype=torch.bfloat16)
    if forward:
        apply_float8(model, Float8Options(recipe=recipe, forward=forward, backward=backward), device=CUDA)
    layer = torch.compile(model.mlp.up_proj) if compiled else model.mlp.up_proj
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out, x.grad, model.mlp.up_proj.weight.grad


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"])
def test_each_role_runs_its_own_precision(recipe: str, compiled: bool) -> None:
    """Tolerance: the same GEMMs in another cuBLAS algorithm or fused by inductor differ by bf16 rounding (norm-
    relative ~1e-3); FP8 against bf16 differs by the FP8 error (~3e-2, asserted above 1e-2), so 5e-3 tells them
    apart."""
    torch.manual_seed(1)
    x = torch.randn(4, 512, 1024, device=CUDA, dtype=torch.bfloat16)
    grad = torch.randn(4, 512, 2048, device=CUDA, dtype=torch.bfloat16)
    fp8 = _run(recipe, "fp8", "fp8", x, grad, compiled=compiled)
    bf16 = _run(recipe, "", "", x, grad, compiled=compiled)
    assert _rel(fp8[0], bf16[0]) > 1e-2 and _rel(fp8[1], bf16[1]) > 1e-2
    out, gx, gw = _run(recipe, "fp8", "bf16", x, grad, compiled=compiled)
    assert _rel(out, fp8[0]) < 5e-3 and _rel(gx, bf16[1]) < 5e-3 and _rel(gw, bf16[2]) < 5e-3
    out, gx, gw = _run(recipe, "bf16", "fp8", x, grad, compiled=compiled)
    assert _rel(out, bf16[0]) < 5e-3 and _rel(gx, fp8[1]) < 5e-3 and _rel(gw, fp8[2]) < 5e-3
