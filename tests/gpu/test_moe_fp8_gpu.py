"""FP8 routed experts on an H100/H200 (`pytest -m gpu tests/gpu/test_moe_fp8_gpu.py`): torch._scaled_grouped_mm
against the emulation the CPU tests pin (tests/unit/test_moe_fp8.py), and no host sync in the layer."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_moe_gpu import forward_backward_without_host_sync
from tests.helpers import count_expert_weight_quantizations
from trainer.models.moe_fp8 import Fp8ExpertWeights, Fp8GroupedSwiGLU, fp8_grouped_swiglu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm90 GPU (H100/H200): torch's rowwise FP8 grouped GEMM"),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("k", [1, 6], ids=["rows", "tokens-top6"])
def test_scaled_grouped_mm_matches_the_emulation_forward_and_gradients(k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    n_tokens, n_experts, dim, hidden = 2048, 16, 512, 384
    x = torch.randn(n_tokens, dim, device="cuda", generator=g).bfloat16()
    w1, w3 = (torch.randn(n_experts, hidden, dim, device="cuda", generator=g).mul(dim ** -0.5).bfloat16()
              for _ in range(2))
    w2 = torch.randn(n_experts, dim, hidden, device="cuda", generator=g).mul(hidden ** -0.5).bfloat16()
    experts = torch.randint(0, n_experts - 1, (n_tokens * k,), device="cuda", generator=g)  # the last one: no rows
    order = torch.argsort(experts, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device="cuda"))
    counts = torch.bincount(experts, minlength=n_experts)
    probe = torch.randn(n_tokens * k, dim, device="cuda", generator=g)
    results = []
    for emulate in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        out = fp8_grouped_swiglu(leaves[0], order // k, inverse, counts, *leaves[1:], k=k,
                                 weights=Fp8ExpertWeights(per_step=False), emulate=emulate, align=16)
        (out.float() * probe).sum().backward()
        results.append((out, *(t.grad for t in leaves)))
    (real, *real_grads), (emulated, *emulated_grads) = results
    # The same e4m3 operands and scales: only the accumulation differs (fast accumulation in the FP8 kernel, a
    # bf16 GEMM of exactly dequantized operands in the emulation), and an intermediate that lands on the other
    # side of an e4m3 rounding boundary. FP8 itself is ~4e-2 from bf16, so 1e-2 / 2e-2 would catch a wrong scale,
    # a transposed weight or a misplaced row.
    assert rel(real, emulated) < 1e-2
    for name, a, b in zip(("x", "w1", "w2", "w3"), real_grads, emulated_grads):
        assert rel(a, b) < 2e-2, name
    assert real_grads[1][-1].abs().max() == 0  # the expert without rows


def test_moe_layer_with_fp8_experts_makes_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests/gpu/test_moe_gpu.py for bf16: at ep=1 without dropping, the FP8 experts keep every size on the
    device (the padded layout, the quantization, the scaled grouped GEMMs, the cached weights)."""
    from trainer.models.moe import MoE, moe_args_for

    args = moe_args_for("moe_16b", n_layers=2)
    torch.manual_seed(0)
    moe = MoE(args).cuda().bfloat16()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe.experts.use(kernel=Fp8GroupedSwiGLU(Fp8ExpertWeights(per_step=True), emulate=False))
    x = torch.randn(2, 4096, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()  # warm-up: compiles the quantization kernels
    moe.experts.kernel.weights.invalidate()  # the next forward quantizes the weights again, in the checked region
    quantized = count_expert_weight_quantizations(monkeypatch)
    forward_backward_without_host_sync(moe, x)
    assert torch.isfinite(x.grad).all()
    assert len(quantized) == 2  # the forward and the dgrad orientation


def test_compiled_weight_quantization_matches_the_eager_one() -> None:
    """The weights' quantization is compiled with static shapes on the GPU (one fused pass per orientation, cat
    and transpose included); it must give the eager reference's bytes and scales, contiguous."""
    from trainer.models.moe_fp8 import _quantize, quantize_dgrad_weights, quantize_forward_weights

    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (torch.randn(8, 384, 512, device="cuda", generator=g).bfloat16() for _ in range(2))
    w2 = torch.randn(8, 512, 384, device="cuda", generator=g).bfloat16()
    w13 = torch.cat([w1, w3], dim=1)
    got = [*quantize_forward_weights(w1, w2, w3), *quantize_dgrad_weights(w1, w2, w3)]
    refs = [w13, w2, w13.transpose(-2, -1).contiguous(), w2.transpose(-2, -1).contiguous()]
    for (data, scale), ref in zip(got, refs):
        want_data, want_scale = _quantize(ref)
        assert data.is_contiguous() and data.shape == ref.shape
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(scale, want_scale)

