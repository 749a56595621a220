"""Our tensorwise FP8 linear (trainer.parallel.float8.tensorwise) on cuBLAS's _scaled_mm: torchao's Float8Linear's
numbers with dynamic scales (eager and compiled), delayed scales from the history, no host sync in a step, and a
compiled profiled train whose GEMMs run in FP8. Run on an H100/H200: `bash scripts/gpu_checks.sh fp8knobs_tests`."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.gpu.test_gpu import _profiled_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)"),
]


def converted(model: nn.Module, *, ours: bool, delayed: bool = False, save: bool = False) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from trainer.parallel.float8.tensorwise import convert_to_tensorwise

    model = copy.deepcopy(model)
    convert_to_float8_training(model, config=Float8LinearConfig())
    if ours:
        convert_to_tensorwise(model, delayed=delayed, save_fp8_input=save)
    return model


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4096, 14336, bias=False), nn.SiLU(),
                         nn.Linear(14336, 4096, bias=False)).cuda().to(torch.bfloat16)


def step(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(g)
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return [out.detach(), x.grad, *grads]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("save", [False, True])
def test_dynamic_scaling_is_torchaos_float8_linear_on_cublas(compiled: bool, save: bool) -> None:
    """8B MLP shapes, 8,192 tokens: output, input and weight gradients equal torchao's tensorwise Float8Linear bit for
    bit (the same casts and the same _scaled_mm calls), with the bf16 or the fp8 input saved for backward."""
    base = mlp()
    theirs, ours = converted(base, ours=False), converted(base, ours=True, save=save)
    if compiled:
        theirs, ours = torch.compile(theirs), torch.compile(ours)
    x = torch.randn(2, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(2, 4096, 4096, device="cuda", dtype=torch.bfloat16) * 1e-3
    for a, b in zip(step(theirs, x, g), step(ours, x, g)):
        assert torch.equal(a, b)


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def test_delayed_scaling_compiled_tracks_dynamic_and_makes_no_host_sync() -> None:
    """Compiled, 3 steps: step 1 (no history) is dynamic scaling bit for bit; steps 2-3 use the history's scales
    (the step hook's, computed on the device: no host sync in the forward, backward and hook) and are as accurate as
    dynamic scaling while the tensors keep their distribution, as in training: each output and gradient's
    norm-relative error against the same step in fp32 is at most 1.25x dynamic scaling's. Both round the same values
    to e4m3 / e5m2 grids of the same density (only the scale differs), so the errors have the same size (2 mantissa
    bits: about 5% per e5m2 cast, twice through the MLP's two dgrads) but are independent: delayed against dynamic
    directly differs by about sqrt(2) times that, 10.8% on 1x H100 (2026-11-26), which a fixed 5% bound refused.
    (An input twice as large as any in the history saturates at e4m3's 448 instead: delayed scaling's known cost,
    which the history's max bounds.)"""
    from trainer.parallel.float8.delayed import DelayedScaling

    base = mlp()
    dynamic = torch.compile(converted(base, ours=False))
    delayed_model = converted(base, ours=True, delayed=True)
    hook = DelayedScaling(delayed_model, history_len=16, algo="max", margin=0, group=None)
    delayed = torch.compile(delayed_model)
    exact = copy.deepcopy(base).float()
    for k in range(3):
        x = torch.randn(2, 4096, 4096, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(2, 4096, 4096, device="cuda", dtype=torch.bfloat16) * 1e-3
        want = step(dynamic, x, g)
        reference = step(exact, x.float(), g.float())
        if k == 2:  # compiled by now: a host sync anywhere in the step raises
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = step(delayed, x, g)
            hook.after_optimizer_step(k + 1, torch.zeros((), dtype=torch.bool, device="cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, b, ref in zip(got, want, reference):
            if k == 0:
                assert torch.equal(a, b)
            else:
                assert relative_error(a, ref) <= 1.25 * relative_error(b, ref)
    assert hook.history[:, :, :3].gt(0).all()


def test_delayed_compiled_train_runs_fp8_gemms(tmp_path: Path) -> None:
    """A compiled 1B-shape train with float8.scaling=delayed and float8.save_fp8_activations: the profile's GEMMs
    run in FP8 and the startup line says delayed."""
    summary, stdout = _profiled_run(tmp_path, "fp8", ["--train.compile_model=true", "--float8.scaling=delayed",
                                                      "--float8.save_fp8_activations=true"])
    print(summary)
    assert "scaling=delayed (amax_history_len=1024, amax_compute_algo=max, margin=0)" in stdout
    assert "fp8 inputs saved for backward" in stdout
    assert "FP8 GEMMs ran: yes" in summary
