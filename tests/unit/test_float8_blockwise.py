"""float8.recipe='blockwise': the emulation against a loop over tiles, the 128-multiple exclusion, config
errors, the loud refusal without kernels, the loss against bf16 and the FP8 health stats."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.models import FLAVORS, Llama, build_model, model_args_for
from trainer.parallel.float8 import Float8Options, apply_float8, select_float8_linears
from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear
from trainer.validate import validate_job

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn


def _reference_qdq(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Quantize -> dequantize written out tile by tile (a trailing partial tile is a tile of its own).

    Per tile: amax, scale = 448 / amax in float64 rounded to fp32, e4m3(clamp(t * scale)), times fp32(1 / scale).
    """
    out = torch.empty(t.shape, dtype=torch.float32)
    for r in range(0, t.shape[0], rows):
        for c in range(0, t.shape[1], cols):
            tile = t[r:r + rows, c:c + cols].float()
            scale = torch.tensor(448.0 / max(tile.abs().max().item(), 1e-12), dtype=torch.float32)
            q = (tile * scale).clamp(-448, 448).to(E4M3)
            out[r:r + rows, c:c + cols] = q.float() * (1 / scale)
    return out


def _reference(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """(out, grad_x, grad_w) of x @ w.T with torchao's tilings: fwd x 1x128 / w 128x128, dgrad g 1x128 / w
    128x128, wgrad g 128x1 / x 128x1 (the contracting dim of each GEMM); each as the pair of dequantized
    operands whose fp32 product it is."""
    wq = _reference_qdq(w, 128, 128)
    return ((_reference_qdq(x, 1, 128), wq.T), (_reference_qdq(g, 1, 128), wq),
            (_reference_qdq(g, 128, 1).T, _reference_qdq(x, 128, 1)))


def _assert_same_product_up_to_summation_order(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`got` is fp32 a @ b summed in some other order than our fp32 a @ b.

    Any fp32 dot product of length K, whatever its summation order (blocked, pairwise, FMA), is within
    gamma_K * sum_k |a_k * b_k| of the exact one, gamma_K = K*u / (1 - K*u), u = 2**-24 (Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., eq. 3.5). Both sides obey it, so each element may differ by
    2 * gamma_K * (|a| @ |b|), computed here in float64. A bound per element, not one atol: entries of |a| @ |b|
    reach 2e4 here (columns up to 1e2, the 3e3 outlier) while the products cancel to much less, so a scalar
    atol/rtol fitted to one CPU failed on another (3.97e-4 against atol=1e-4, issue 30; the worst element measured
    is 0.007x this bound). Still tight: the fp8 rounding, which a wrong scale or tiling would change, moves the
    median element 80-230x this bound from the exact product.
    """
    want = a @ b
    k = a.shape[1]
    u = torch.finfo(torch.float32).eps / 2
    gamma = k * u / (1 - k * u)
    bound = 2 * gamma * (a.double().abs() @ b.double().abs())
    excess = (got.double() - want.double()).abs() / bound
    assert excess.max() <= 1, (f"{int((excess > 1).sum())} of {got.numel()} elements differ from the tile loop by "
                               f"more than summation order allows (worst: {excess.max().item():.3g}x the bound)")


@pytest.mark.parametrize("tokens", [256, 200])  # 200: a partial 128-token tile (zero-padded by the module)
def test_emulation_matches_a_loop_over_tiles(tokens: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(tokens, 256) * torch.logspace(-3, 2, 256)  # columns of very different magnitude
    x[5, 7] = 3e3  # an outlier: in blockwise only its own 1x128 tile (and 128x1 group) loses precision
    w, g = torch.randn(128, 256) * 0.05, torch.randn(tokens, 128)
    layer = BlockwiseFloat8Linear.from_linear(torch.nn.Linear(256, 128, bias=False), emulate=True)
    with torch.no_grad():
        layer.weight.copy_(w)
    xg = x.clone().requires_grad_()
    out = layer(xg)
    out.backward(g)
    # Same dequantized operands (the module's zero-padded rows add exact zeros), fp32 matmuls: only the
    # summation order differs.
    for got, (a, b) in zip((out, xg.grad, layer.weight.grad), _reference(x, w, g)):
        _assert_same_product_up_to_summation_order(got, a, b)
    # Quantization ran, at fp8 precision: neither exact nor far from the fp32 product.
    exact = x @ w.T
    rel = (out - exact).norm() / exact.norm()
    assert 1e-3 < rel < 0.05, rel


def test_blockwise_keeps_dims_not_multiples_of_128_in_bf16_and_says_so(caplog) -> None:
    model = Llama(FLAVORS["debug"])  # dim 128, k/v_proj 128 -> 64
    model.init_weights(seed=0)
    with caplog.at_level(logging.INFO, logger="trainer"):
        report = apply_float8(model, Float8Options(recipe="blockwise", emulate=True), device=CPU)
    assert report.linears.num_linear == 29 and len(report.linears.converted) == 21
    assert type(model.layers["0"].attention.q_proj) is BlockwiseFloat8Linear
    assert type(model.layers["0"].attention.k_proj) is torch.nn.Linear
    text = [r.getMessage() for r in caplog.records]
    assert "Applied Float8 training: recipe=BLOCKWISE, fsdp_float8_all_gather=False, format=e4m3 everywhere" in text
    assert ("converted 21/29 Linear layers; excluded: layers.{0..3}.{attention.k_proj,attention.v_proj} "
            "(shape 128x64: dims not multiples of 128 (blockwise))") in text
    assert any(m.startswith("float8 matmuls: EMULATED in plain torch (blockwise") for m in text)
    # The run's fp8_layers.json is validate_job's float8_layers: the same fates.
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8", "--float8.recipe=blockwise",
                           "--float8.emulate=true"])
    fates = validate_job(cfg, world_size=1).float8_layers
    assert fates["layers.0.attention.v_proj"] == "shape 128x64: dims not multiples of 128 (blockwise)"
    assert fates["layers.0.mlp.down_proj"] == fates["output_head.proj"] == "converted"
    # Tensorwise converts them (multiples of 16 suffice).
    assert select_float8_linears(model, exclude_fqns=[])[1] == {}


def test_moe_blockwise_converts_attention_and_dense_layers_not_experts() -> None:
    with torch.device("meta"):
        model = build_model(model_args_for("debug_moe"))
    converted, excluded, _ = select_float8_linears(model, exclude_fqns=[], recipe="blockwise")
    assert "layers.0.mlp.gate_proj" in converted and "layers.1.attention.q_proj" in converted  # layer 0 is dense
    assert excluded["layers.1.moe.router.gate"] == "MoE router"
    assert not any(".moe." in fqn for fqn in converted)


@pytest.mark.parametrize("args, message", [
    (["--float8.enable_fsdp_float8_all_gather=true"],
     "float8.enable_fsdp_float8_all_gather=true only works with float8.recipe='tensorwise' (got recipe='blockwise'); "
     "set --float8.enable_fsdp_float8_all_gather=auto (or false)"),
    (["--float8.require=true"], "float8.recipe='blockwise' with float8.require=true, but there is no CUDA GPU"),
])
def test_bad_blockwise_config_is_one_line_naming_the_key(args: list[str], message: str) -> None:
    if torch.cuda.is_available() and "require" in args[0]:
        pytest.skip("checks the no-GPU refusal")
    with pytest.raises(ConfigError) as e:  # the one validation pass: config checks, then the resolved options
        validate_job(load_job_config(["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8",
                                      "--float8.recipe=blockwise", *args]), world_size=1)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_blockwise_all_gather_auto_is_off_with_sharding() -> None:
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8", "--float8.recipe=blockwise"])
    assert validate_job(cfg, world_size=2).build.float8.enable_fsdp_float8_all_gather is False


def test_blockwise_without_kernels_warns_loudly_or_fails(caplog) -> None:
    model = Llama(FLAVORS["debug"])
    with caplog.at_level(logging.WARNING, logger="trainer"):
        report = apply_float8(model, Float8Options(recipe="blockwise"), device=CPU)
    assert not report.enabled and not any(isinstance(m, BlockwiseFloat8Linear) for m in model.modules())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "FP8 IS UNAVAILABLE ON THIS DEVICE: CPU has no blockwise FP8 kernels" in text and "BF16 instead" in text
    with pytest.raises(ValueError, match="float8.require=true, so stopping"):
        apply_float8(Llama(FLAVORS["debug"]), Float8Options(recipe="blockwise", require=True), device=CPU)


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    from trainer.loss import LossFn

    loss = LossFn(model.norm, model.output_head)(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_blockwise_model_loss_close_to_bf16_and_not_equal() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (2, 65))  # 2 x 64 = 128 tokens: one 128-token group in the wgrad
    runs = {}
    for name in ("bf16", "blockwise"):
        model = Llama(FLAVORS["debug"])
        model.init_weights(seed=0)
        model.to(torch.bfloat16)
        if name == "blockwise":
            apply_float8(model, Float8Options(recipe="blockwise", emulate=True), device=CPU)
        runs[name] = _loss_and_grads(model, tokens)
    (bf16_loss, bf16_grads), (fp8_loss, fp8_grads) = runs["bf16"], runs["blockwise"]
    assert fp8_loss != bf16_loss and fp8_loss == pytest.approx(bf16_loss, rel=1e-2)
    name = "layers.1.mlp.up_proj.weight"  # a converted layer's gradient: fp8 noise, not a different gradient
    rel = (fp8_grads[name] - bf16_grads[name]).norm() / bf16_grads[name].norm()
    assert 1e-3 < rel < 0.2, rel


def test_health_stats_cover_blockwise_layers() -> None:
    from trainer.parallel.float8 import float8_weight_stats
    from trainer.parallel.float8.health import Fp8HealthMonitor

    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    apply_float8(model, Float8Options(recipe="blockwise", emulate=True), device=CPU)
    monitor = Fp8HealthMonitor(model, recipe="blockwise")
    assert len(monitor.modules) == 21 and set(monitor.formats.values()) == {(True, 128, "e4m3")}
    with monitor.collect():
        _loss_and_grads(model, torch.randint(0, 512, (2, 65)))
    stats = monitor.report()
    assert {"fp8_health/input/attention.q_proj/scale", "fp8_health/grad/output_head.proj/underflow"} <= set(stats)
    assert not any("k_proj" in key for key in stats)
    weights = float8_weight_stats(model)
    assert "fp8/weight_amax/layers.0.attention.q_proj" in weights and len(weights) == 2 * 21


@pytest.mark.slow
def test_compiled_emulation_equals_eager() -> None:
    """torch.compile traces the emulation (forward and backward) to the same numbers as eager."""
    torch.manual_seed(0)
    x, g = torch.randn(200, 256, dtype=torch.bfloat16), torch.randn(200, 128, dtype=torch.bfloat16)
    layer = BlockwiseFloat8Linear.from_linear(torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16),
                                              emulate=True)
    results = []
    for fn in (layer, torch.compile(layer)):
        layer.weight.grad = None
        xg = x.clone().requires_grad_()
        out = fn(xg)
        out.backward(g)
        results.append((out, xg.grad, layer.weight.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
