"""AdamW with moments of their own (trainer/optim/adamw.py) on CUDA tensors: its eager update (tests/unit/test_optim_states.py) on
the GPU rounds as on the CPU, and its Triton kernel as the eager update. The same random bits pick the same neighbour
unless the fp32 values differ in their last bits (CUDA's lerp and FMA contractions against the CPU's), which moves a
rounding by at most one ulp of the state's dtype, rarely; fp32 states differ by those last bits."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_optim_kernel import step_through
from tests.unit.test_optim_states import COMBOS, SHAPES, _optimizer
from tests.unit.test_optim_states_kernel import COMBOS as KERNEL_COMBOS
from tests.unit.test_optim_states_kernel import _values, check_same_bits, check_within_an_ulp, runs
from trainer.optim.states import StateDtypes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(combo: tuple[str, str, str], device: str, steps: int = 4) -> list[list[tuple[torch.Tensor, torch.dtype]]]:
    """The eager update's weights and states, (fp32 value on the CPU, stored dtype) per tensor."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float32 if combo[0] == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter((1 + torch.rand(s, generator=gen)).to(dtype).to(device)) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(dtype).to(device) for s in SHAPES] for _ in range(steps)]
    opt = _optimizer(params, StateDtypes(*combo))
    step_through(opt, params, grads, device=device)
    return [[(v.cpu(), d) for v, d in _values(opt, p)] for p in params]


@pytest.mark.parametrize("combo", COMBOS)
def test_the_gpu_update_rounds_as_the_cpu_one(combo: tuple[str, str, str]) -> None:
    check_within_an_ulp((_run(combo, "cpu"), None), (_run(combo, "cuda"), None))


@pytest.mark.parametrize("combo", KERNEL_COMBOS)
def test_the_kernel_rounds_as_the_eager_update_on_the_gpu(combo: tuple[str, str, str]) -> None:
    """The Triton kernel of moments of their own compiled for the GPU: the interpreter's comparisons
    (tests/unit/test_optim_states_kernel.py) on CUDA tensors."""
    check_same_bits(*runs(combo, beta1=0.5, device="cuda"))
    check_within_an_ulp(*runs(combo, device="cuda"))


def test_the_kernel_is_what_runs_on_a_gpu() -> None:
    from trainer.optim import describe_optimizer_state

    p = torch.nn.Parameter(torch.randn(256, 256, device="cuda"))
    opt = _optimizer([p], StateDtypes("fp32", "fp8", "bf16"), implementation="triton")
    assert "update: the Triton kernel" in describe_optimizer_state(opt)
