"""The compiled FP8 output head's loss (trainer.loss.Float8HeadCrossEntropy) and its kernels (trainer/loss_kernels.py,
run by Triton's CPU interpreter): the kernels against their torch references, the FP8 gradient it hands torchao
against torchao's own cast of the same bf16 gradient, and the whole head and loss against the module and
F.cross_entropy. tests/gpu/test_fused_head_loss_gpu.py runs the kernels on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale  # noqa: E402

import trainer.loss as loss_module  # noqa: E402
from trainer.loss import (FP8_FORMATS, IGNORE_INDEX, LossFn, logits_grad_reference, plain_float8_head,  # noqa: E402
                          row_stats_reference)
from trainer.models.layers import RMSNorm  # noqa: E402
from tests.helpers import under_triton_interpreter  # noqa: E402

E5M2, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn


def logits_and_labels(n: int = 70, vocab: int = 1000, seed: int = 0):
    """bf16 logits wide enough that some rows are confident (p(label) near 1) and some ignored labels."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 4).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[:5] = IGNORE_INDEX
    confident = labels[5:9]
    logits[5:9].scatter_(1, confident[:, None], 40.0)  # p(label) ~ 1: |p - 1| tiny, another p the row's largest
    return logits, labels


def scale_for(amax_rows: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return amax_to_scale((amax_rows.amax() * g.abs()).bfloat16().float(), dtype)


@pytest.mark.parametrize("dtype", [E5M2, E4M3])
def test_the_gradient_handed_to_torchao_is_its_own_cast_of_the_bf16_gradient(dtype) -> None:
    """The amax from forward's row statistics is the bf16 gradient's (rounding keeps order), so the FP8 bytes and
    scale are exactly what torchao's dynamic cast makes of that gradient, and the transposed copy is its transpose."""
    logits, labels = logits_and_labels()
    lse, _, amax = row_stats_reference(logits, labels)
    g = torch.tensor(1 / 293)
    grad = logits_grad_reference(logits, lse, labels, g)
    scale = scale_for(amax, g, dtype)
    data, data_t = logits_grad_reference(logits, lse, labels, g, scale, dtype)
    theirs = hp_tensor_to_float8_dynamic(grad, dtype, LinearMMConfig(), gemm_input_role=GemmInputRole.GRAD_OUTPUT)
    assert torch.equal(scale, theirs._scale)
    assert torch.equal(data.view(torch.uint8), theirs._data.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t())


def test_the_bf16_gradient_is_cross_entropys_within_its_rounding() -> None:
    logits, labels = logits_and_labels()
    lse, loss, _ = row_stats_reference(logits, labels)
    ref_logits = logits.float().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    (ref / 293).backward()
    torch.testing.assert_close(loss.sum(), ref.detach(), rtol=1e-6, atol=0)  # fp32 sums of the same terms
    grad = logits_grad_reference(logits, lse, labels, torch.tensor(1 / 293)).float()
    # the same fp32 expression up to its order (a few ulps), then one bf16 rounding: within one bf16 step
    expected = ref_logits.grad
    assert ((grad - expected).abs() <= expected.abs() * 2.0**-8 + 1e-12).all()
    assert (grad[:5] == 0).all()


@pytest.fixture()
def interpreted_kernels():
    """trainer.loss_kernels built for Triton's interpreter (decided when @triton.jit runs and by its INTERPRETED
    flag), then as it was."""
    pytest.importorskip("triton", reason="Triton has no wheel for this platform (the test extra installs it on Linux)")
    import trainer.loss_kernels as kernels

    with under_triton_interpreter(kernels) as interpreted:
        yield interpreted


@pytest.mark.parametrize("dtype", [E5M2, E4M3])
def test_kernels_compute_their_references(interpreted_kernels, dtype, monkeypatch) -> None:
    """Row statistics over three loop steps of 128 logits (a tail in the last), the FP8 gradient pair over tiles
    with tails (24 rows, 300 columns), ignored rows and confident rows; the roundings bit for bit. (Small: the
    interpreter runs each reduction's combine in Python.)"""
    logits, labels = logits_and_labels(24, 300)
    monkeypatch.setattr(interpreted_kernels, "ROW_BLOCK", 128)
    stats = interpreted_kernels.row_stats(logits, labels)
    for ours, ref in zip(stats, row_stats_reference(logits, labels)):
        # 300 exps summed in another order, numpy's exp and log against torch's: a few fp32 ulps of the log-sum-exp
        # (2e-6 at its ~20), which the loss (near 0 on confident rows) and the amax inherit
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    lse, _, amax = stats
    g = torch.tensor(1 / 293)
    scale = scale_for(amax, g, dtype)
    top, mbits, bias = FP8_FORMATS[dtype]
    data, data_t = interpreted_kernels.logits_grad_fp8(logits, lse, labels, g, scale, top, mbits, bias, dtype)
    ref, ref_t = logits_grad_reference(logits, lse, labels, g, scale, dtype)
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), ref_t.view(torch.uint8))


def test_kernel_fp8_rounding_at_the_formats_edges(interpreted_kernels) -> None:
    """The kernels' integer rounding to FP8 against torch's casts: subnormals and their carry into the smallest
    normal, ties to even, the largest value, zeros of both signs, random values over the whole range."""
    import triton
    import triton.language as tl

    global _fp8_bytes  # the kernel below finds it among this module's globals (the interpreter sees no closure)
    _fp8_bytes = interpreted_kernels._fp8_bytes

    @triton.jit
    def cast(x_ptr, y_ptr, n, MBITS: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, _fp8_bytes(tl.load(x_ptr + offs, mask=offs < n), MBITS, BIAS, SUB), mask=offs < n)

    for dtype, (top, mbits, bias) in FP8_FORMATS.items():
        tiny = 2.0 ** (1 - bias - mbits)  # the smallest subnormal
        edges = torch.tensor([0.0, tiny / 2, tiny * 1.5, tiny * 2.5, tiny * (2**mbits - 0.5), 2.0 ** (1 - bias),
                              top, 1.0 + 2.0**-mbits / 2, 1.0 + 3 * 2.0**-mbits / 2, 3.0 * (1 + 2.0**-mbits / 2)])
        g = torch.Generator().manual_seed(0)
        values = torch.cat([edges, -edges, torch.randn(4000, generator=g) * top / 8,
                            torch.randn(4000, generator=g) * tiny * 8]).clamp(-top, top)
        out = torch.empty(values.numel(), dtype=torch.uint8)
        cast[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), MBITS=mbits, BIAS=bias,
                                                   SUB=2.0 ** (bias - 1 + mbits), BLOCK=1024)
        assert torch.equal(out, values.to(dtype).view(torch.uint8)), dtype


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


def fp8_head(dim: int = 64, vocab: int = 1000, **config) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    head, norm = Head(dim, vocab), RMSNorm(dim, 1e-5)
    convert_to_float8_training(head, config=Float8LinearConfig(**config))
    return head.bfloat16(), norm.bfloat16()


def run(loss_fn: LossFn, head: nn.Module, h0: torch.Tensor, labels: torch.Tensor):
    h = h0.clone().requires_grad_(True)
    loss = loss_fn(h, labels)
    loss.backward()
    return loss.detach(), h.grad, head.proj.weight.grad


def check_fused_tracks_the_module(dim: int, vocab: int, tokens: int, device: str = "cpu") -> None:
    """The compiled loss with the fused path, then with it off (the same compiled graph with the module and
    F.cross_entropy), on the same FP8 head: the same FP8 GEMMs, so the loss agrees within fp32 summation and the
    gradients within the FP8 gradient's rounding (an element whose bf16 gradient rounds the other way lands one
    e5m2 step apart)."""
    torch.manual_seed(1)
    h0 = (torch.randn(2, tokens, dim) * 3).bfloat16().to(device)
    labels = torch.randint(0, vocab, (2, tokens)).to(device)
    labels[0, :9] = IGNORE_INDEX
    results = {}
    for fused in (True, False):
        head, norm = (m.to(device) for m in fp8_head(dim, vocab))
        loss_fn = LossFn(norm, head, compile=True)
        assert loss_fn.fp8_head_class is Float8Linear
        if not fused:
            loss_fn.fp8_head_class = None
        results[fused] = [run(loss_fn, head, h0, labels) for _ in range(2)][-1]
    (loss, dh, dw), (ref_loss, ref_dh, ref_dw) = results[True], results[False]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for ours, ref in ((dh, ref_dh), (dw, ref_dw)):
        assert ((ours.float() - ref.float()).norm() / ref.float().norm()) < 3e-2
        assert torch.isfinite(ours).all()


def test_compiled_fp8_head_loss_tracks_the_module_and_cross_entropy(monkeypatch) -> None:
    """check_fused_tracks_the_module on CPU tensors, its row statistics called on every fused step."""
    calls = []
    real = loss_module.row_stats_reference
    monkeypatch.setattr(loss_module, "row_stats_reference", lambda *a: calls.append(1) or real(*a))
    check_fused_tracks_the_module(64, 1000, 150)
    assert len(calls) == 2


def test_a_bf16_head_class_recompiles_to_the_module() -> None:
    """An evaluation or precision phase in bf16 makes the head's Linear a plain nn.Linear: the compiled loss then
    runs it in bf16 (the same result as the eager module), not the FP8 path it compiled first."""
    torch.manual_seed(2)
    h0 = torch.randn(1, 64, 64).bfloat16()
    labels = torch.randint(0, 1000, (1, 64))
    head, norm = fp8_head()
    loss_fn = LossFn(norm, head, compile=True)
    run(loss_fn, head, h0, labels)
    head.proj.__class__ = nn.Linear
    with torch.no_grad():
        compiled = loss_fn(h0, labels)
        eager = F.cross_entropy(head(norm(h0)).flatten(0, 1).float(), labels.flatten())
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)


def test_plain_float8_head_accepts_the_default_tensorwise_linear() -> None:
    head, _ = fp8_head()
    assert plain_float8_head(head.proj) is Float8Linear
    from torchao.float8 import CastConfig

    e4m3_grads, _ = fp8_head(cast_config_grad_output=CastConfig(target_dtype=E4M3))  # float8.format = "e4m3"
    assert plain_float8_head(e4m3_grads.proj) is Float8Linear


def test_plain_float8_head_refuses_what_it_does_not_cast_as_torchao() -> None:
    rowwise, _ = fp8_head()
    rowwise.proj.config = Float8LinearConfig.from_recipe_name("rowwise")
    assert plain_float8_head(rowwise.proj) is None
    hooked, _ = fp8_head()
    hooked.proj.register_forward_hook(lambda *a: None)
    assert plain_float8_head(hooked.proj) is None
    assert plain_float8_head(nn.Linear(4, 4)) is None
    assert plain_float8_head(None) is None
    from trainer.parallel.float8.tensorwise import convert_to_tensorwise

    ours, _ = fp8_head()
    convert_to_tensorwise(ours, delayed=False, save_fp8_input=True)
    assert plain_float8_head(ours.proj) is None
