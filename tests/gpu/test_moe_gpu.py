"""MoE on CUDA (run on an H100/H200: `pytest -m gpu tests/gpu`): the bf16 grouped GEMM against a per-expert loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import launch
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


def test_debug_moe_trains_in_bf16_on_gpu(tmp_path: Path) -> None:
    proc = launch(["--config", "configs/train/debug_moe.toml", "--train.mixed_precision=bf16", "--train.steps=20",
                   "--metrics.log_freq=5", f"--job.dump_folder={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MoE experts in" not in proc.stderr  # no per-expert loop fallback: the grouped GEMM ran
