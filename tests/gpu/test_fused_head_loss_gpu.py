"""The compiled FP8 output head's loss on a GPU: trainer/loss_kernels.py compiled for CUDA (its hardware FP8 and bf16
conversions, not the interpreter's integer rounding) against the torch references, and the whole head and loss
against the module and F.cross_entropy (tests/unit/test_fused_head_loss.py's comparisons)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

pytest.importorskip("torchao")

from tests.unit.test_fused_head_loss import logits_and_labels, scale_for  # noqa: E402
from trainer import loss_kernels  # noqa: E402
from trainer.loss import FP8_FORMATS, logits_grad_reference, row_stats_reference  # noqa: E402


@pytest.mark.parametrize("dtype", list(FP8_FORMATS))
def test_kernels_on_the_gpu_compute_their_references(dtype) -> None:
    """The GPU's exp is not torch's to the last ulp: the statistics agree to a few ulps, and a gradient element
    whose bf16 value rounds the other way (rare) lands at most one FP8 step from the reference's byte; the
    transposed copy is the other's transpose, bit for bit."""
    logits, labels = (t.cuda() for t in logits_and_labels(1000, 50_000))
    stats = loss_kernels.row_stats(logits, labels)
    for ours, ref in zip(stats, row_stats_reference(logits, labels)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    lse, _, amax = stats
    g = torch.tensor(1 / 4000, device="cuda")
    scale = scale_for(amax, g, dtype)
    data, data_t = loss_kernels.logits_grad_fp8(logits, lse, labels, g, scale, *FP8_FORMATS[dtype], dtype)
    ref, _ = logits_grad_reference(logits, lse, labels, g, scale, dtype)
    ours_bytes, ref_bytes = data.view(torch.uint8), ref.view(torch.uint8)
    assert torch.equal(data_t.view(torch.uint8), ours_bytes.t())
    differ = ours_bytes != ref_bytes
    assert differ.float().mean() < 1e-4
    # same sign, neighbouring codes (an FP8 byte's magnitude bits count up with the value)
    assert ((ours_bytes[differ].int() - ref_bytes[differ].int()).abs() <= 1).all()


def test_compiled_fp8_head_loss_tracks_the_module_on_the_gpu(monkeypatch) -> None:
    """tests/unit/test_fused_head_loss.py's end-to-end comparison on CUDA tensors, the kernels doing the work."""
    from tests.unit import test_fused_head_loss as cpu

    monkeypatch.setattr(cpu.loss_module, "row_stats_reference", lambda *a: pytest.fail("the GPU runs the kernel"))
    cpu.check_fused_tracks_the_module(256, 4000, 1024, "cuda")
