"""MoE on CUDA (run on an H100/H200: `pytest -m gpu tests/gpu`): the bf16 grouped GEMM against a per-expert loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import column, launch, read_metrics
from trainer.models.moe import GROUP_ALIGN, grouped_swiglu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _loop(x, counts, w1, w2, w3):
    rows, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c].float()
        h = F.silu(xe @ w1[e].float().T) * (xe @ w3[e].float().T)
        rows.append(h @ w2[e].float().T)
        start += c
    return torch.cat(rows)


@pytest.mark.parametrize("counts", [[37, 0, 128, 5, 1, 300, 16, 17], [0] * 7 + [64]], ids=["ragged", "one-expert"])
def test_cuda_grouped_gemm_matches_per_expert_loop(counts: list[int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    dim, hidden, n = 256, 384, len(counts)
    x = torch.randn(sum(counts), dim, device="cuda", generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(n, hidden, dim, device="cuda", generator=g).mul(0.05).bfloat16().requires_grad_()
              for _ in range(2))
    w2 = torch.randn(n, dim, hidden, device="cuda", generator=g).mul(0.05).bfloat16().requires_grad_()
    c = torch.tensor(counts, device="cuda")
    out = grouped_swiglu(x, c, w1, w2, w3)  # torch._grouped_mm, groups padded to GROUP_ALIGN rows
    assert out.dtype == torch.bfloat16 and GROUP_ALIGN % 8 == 0
    ref = _loop(x, c, w1, w2, w3)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2  # bf16 inputs and output
    probe = torch.randn(out.shape, device="cuda", generator=g)
    (out.float() * probe).sum().backward()
    got = [t.grad.float().clone() for t in (x, w1, w2, w3)]
    for t in (x, w1, w2, w3):
        t.grad = None
    (ref * probe).sum().backward()
    for a, t in zip(got, (x, w1, w2, w3)):
        assert ((a - t.grad.float()).norm() / t.grad.float().norm()).item() < 2e-2


def test_debug_moe_trains_in_bf16_on_gpu_as_the_fp32_expert_loop_does(tmp_path: Path) -> None:
    """The debug MoE model, 20 steps on the GPU: bf16 through the grouped GEMMs against fp32, whose experts run as
    the per-expert loop of matmuls (an independent path; the same CUDA-seeded init and the same batches).
    bf16 rounding moves the losses by far less than training moves them."""
    args = ["--config", "configs/train/debug_moe.toml", "--train.steps=20", "--metrics.log_freq=5",
            "--metrics.enable_tensorboard=false"]
    bf16 = launch([*args, "--train.mixed_precision=bf16", f"--job.dump_folder={tmp_path / 'bf16'}"], timeout=600)
    assert bf16.returncode == 0, bf16.stdout[-3000:] + bf16.stderr[-3000:]
    assert " on cuda:0" in bf16.stdout + bf16.stderr  # the startup line: it trained on the GPU
    assert "MoE experts in" not in bf16.stdout + bf16.stderr  # no per-expert loop fallback: the grouped GEMM ran
    fp32 = launch([*args, "--train.mixed_precision=fp32", f"--job.dump_folder={tmp_path / 'fp32'}"], timeout=600)
    assert fp32.returncode == 0, fp32.stdout[-3000:] + fp32.stderr[-3000:]
    assert "MoE experts in torch.float32 on CUDA" in fp32.stdout + fp32.stderr  # the loop ran (said once)
    got, ref = read_metrics(tmp_path / "bf16"), read_metrics(tmp_path / "fp32")
    assert column(got, "step") == column(ref, "step") == [1, 5, 10, 15, 20]
    loss, ref_loss = column(got, "loss"), column(ref, "loss")
    assert loss[0] == pytest.approx(ref_loss[0], rel=1e-2)
    assert loss[-1] == pytest.approx(ref_loss[-1], rel=5e-2)
    assert loss[-1] < loss[0] - 2.0  # it trains
    assert column(got, "aux_loss")[0] == pytest.approx(column(ref, "aux_loss")[0], rel=5e-2)


def test_moe_layer_forward_and_backward_make_no_host_sync() -> None:
    """At ep=1 without token dropping the layer never waits on the GPU: routing, the expert sort, the grouped
    GEMMs and the gathers that move rows (trainer/models/moe_permute.py) all keep sizes on the device.
    torch's sync debug mode raises on any synchronizing call (.item(), .tolist(), nonzero, ...)."""
    from trainer.models.moe import MoE, moe_args_for

    args = moe_args_for("moe_16b", n_layers=2)  # 64 experts top-6, dim 2048, 2 shared
    torch.manual_seed(0)
    moe = MoE(args).cuda().bfloat16()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(2, 4096, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()  # warm-up: lazy inits may sync once
    forward_backward_without_host_sync(moe, x)
    assert torch.isfinite(x.grad).all()


def forward_backward_without_host_sync(module: torch.nn.Module, x: torch.Tensor) -> None:
    """One forward and backward under torch's sync debug mode "error" (raises on any synchronizing call)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        module(x).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
