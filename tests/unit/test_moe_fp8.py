"""FP8 routed experts (float8.moe_experts='rowwise'), emulated on CPU: the grouped GEMMs against a per-expert loop
written here, the quantization fused into the expert gather, the once-per-step weight cache, config errors (training:
tests/cli/test_moe_fp8.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import count_expert_weight_quantizations
from trainer.models.moe import MOE_FLAVORS, MoE, grouped_swiglu
from trainer.models.moe_fp8 import (Fp8ExpertWeights, Fp8GroupedSwiGLU, build_row_plan, fp8_grouped_swiglu,
                                   quantize_rows)
from trainer.models.moe_permute import inverse_permutation

MOE_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "train" / "debug_moe.toml")


def q(x: torch.Tensor) -> torch.Tensor:
    """Reference rowwise e4m3 round trip along the last dim, power-of-two scale = 2^floor(log2(448 / amax))."""
    scale = torch.exp2(torch.floor(torch.log2(448.0 / x.abs().amax(-1, keepdim=True).clamp(min=1e-12))))
    return (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


def reference(x, counts, w1, w2, w3, probe):
    """One expert at a time: outputs and, for loss = sum(out * probe), the gradients the FP8 experts define
    (dgrad: quantized gradient x weight quantized along its output dim; wgrad: gradient x quantized input)."""
    outs, grads = [], {"x": [], "w1": [], "w2": [], "w3": []}
    start = 0
    for e, c in enumerate(counts.tolist()):
        xe, ge = x[start:start + c], probe[start:start + c]
        start += c
        h1, h3 = q(xe) @ q(w1[e]).T, q(xe) @ q(w3[e]).T
        h = F.silu(h1) * h3
        outs.append(q(h) @ q(w2[e]).T)
        dh = q(ge) @ q(w2[e].T).T
        s = torch.sigmoid(h1)
        dh1, dh3 = dh * h3 * s * (1 + h1 * (1 - s)), dh * F.silu(h1)
        w13 = torch.cat([w1[e], w3[e]])
        grads["x"].append(q(torch.cat([dh1, dh3], 1)) @ q(w13.T).T)
        grads["w2"].append(ge.T @ q(h))
        grads["w1"].append(dh1.T @ q(xe))
        grads["w3"].append(dh3.T @ q(xe))
    return torch.cat(outs), {k: torch.cat(v) if k == "x" else torch.stack(v) for k, v in grads.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _routing(n_tokens: int, k: int, n_experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, n_experts, (n_tokens * k,), generator=g)
    experts[:k] = n_experts - 1  # one expert with rows, another (0 below) may have none
    experts[experts == 0] = 1
    order = torch.argsort(experts, stable=True)
    return order, inverse_permutation(order), torch.bincount(experts, minlength=n_experts)


def test_emulated_fp8_experts_match_a_per_expert_loop_forward_and_gradients() -> None:
    torch.manual_seed(0)
    n_tokens, k, n_experts, dim, hidden = 40, 2, 5, 32, 48
    x = torch.randn(n_tokens, dim, requires_grad=True)
    w1, w3 = ((0.1 * torch.randn(n_experts, hidden, dim)).requires_grad_() for _ in range(2))
    w2 = (0.1 * torch.randn(n_experts, dim, hidden)).requires_grad_()
    order, inverse, counts = _routing(n_tokens, k, n_experts, seed=1)
    assert counts[0] == 0
    out = fp8_grouped_swiglu(x, order // k, inverse, counts, w1, w2, w3, k=k,
                             weights=Fp8ExpertWeights(per_step=False), emulate=True, align=16)
    probe = torch.randn(out.shape)
    (out * probe).sum().backward()
    rows = x.detach()[order // k]
    want, grads = reference(rows, counts, w1.detach(), w2.detach(), w3.detach(), probe)
    # Same quantized operands; fp32 GEMMs that sum in another order (a rare h element may round to the
    # neighbouring e4m3 value). The bf16 experts are ~5e-2 away, so the FP8 rounding is what is compared.
    assert rel(out.detach(), want) < 1e-3
    assert rel(grouped_swiglu(rows, counts, w1.detach(), w2.detach(), w3.detach()), want) > 1e-2
    x_grad = torch.zeros_like(x).index_add_(0, order // k, grads["x"])  # each token's k copies summed
    assert rel(x.grad, x_grad) < 1e-3
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        assert rel(w.grad, grads[name]) < 1e-3, name
    assert w1.grad[0].abs().max() == 0  # an expert without rows gets no gradient


def test_quantizing_tokens_before_the_gather_equals_quantizing_the_gathered_rows() -> None:
    torch.manual_seed(0)
    n_tokens, k, n_experts, dim = 30, 3, 4, 64
    x = (torch.randn(n_tokens, dim) * torch.logspace(-3, 2, n_tokens)[:, None]).bfloat16()
    order, inverse, counts = _routing(n_tokens, k, n_experts, seed=2)
    plan = build_row_plan(counts, order // k, inverse, n_source=n_tokens, k=k, align=16)
    data, scale = quantize_rows(x)  # each token once
    fused = data.index_select(0, plan.data_rows), torch.cat([scale, scale.new_zeros(1)])[plan.scale_rows]
    # Quantize after the permutation, on the zero-padded buffer the bf16 path builds.
    padded = x.new_zeros(plan.scale_rows.shape[0], dim).index_copy(0, plan.dst, x[order // k])
    after = quantize_rows(padded)
    real = plan.dst
    assert torch.equal(fused[0][real].view(torch.uint8), after[0][real].view(torch.uint8))
    assert torch.equal(fused[1][real], after[1][real])
    pad = torch.ones(padded.shape[0], dtype=torch.bool).index_fill(0, real, False)
    assert (fused[1][pad] == 0).all()  # padding rows dequantize to zero
    assert torch.isfinite(fused[0][pad].float()).all()


def _moe_with_fp8(*, per_step: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dataclasses.replace(MOE_FLAVORS["debug_moe"], n_shared_experts=0))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    moe.experts.use(kernel=Fp8GroupedSwiGLU(Fp8ExpertWeights(per_step=per_step), emulate=True))
    return moe


def test_expert_weights_are_quantized_once_per_optimizer_step_with_grad_accumulation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.parallel.float8 import Fp8ExpertWeightsRefresh

    quantized = count_expert_weight_quantizations(monkeypatch)
    moe = _moe_with_fp8(per_step=True)
    hook = Fp8ExpertWeightsRefresh(moe)
    assert hook.caches == [moe.experts.kernel.weights]
    x = torch.randn(3, 2, 16, 128)
    for step in (1, 2):
        with hook.step_context(step):
            for micro in x:  # three microbatches of one step
                moe(micro).square().mean().backward()
            hook.after_forward_backward(step)
        assert len(quantized) == 2 * step  # the forward and the dgrad orientation, once each
        with torch.no_grad():
            moe.experts.w1.add_(0.01)  # the optimizer step
        hook.after_optimizer_step(step, torch.tensor(False))
    with torch.no_grad():  # between steps (an evaluation, maybe the EMA swapped in): nothing read, nothing kept
        moe(x[0]), moe(x[0])
    assert len(quantized) == 6 and not moe.experts.kernel.weights._cached
    unkept = _moe_with_fp8(per_step=False)  # one forward per step, or FSDP-sharded experts: nothing is kept
    quantized.clear()
    for micro in x:
        unkept(micro).square().mean().backward()
    assert len(quantized) == 6


def test_unkept_expert_weights_are_quantized_where_used_and_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without per_step, forward quantizes only its orientation and backward the other: no FP8 copy of a layer's
    weights lives from its forward to its backward (the memory that keeping them for the step cost)."""
    import weakref

    import trainer.models.moe_fp8 as moe_fp8

    made = []

    def recording(quantize):
        def run(*weights):
            out = quantize(*weights)
            made.extend(weakref.ref(data) for data, _ in out)
            return out
        return run

    quantized = count_expert_weight_quantizations(monkeypatch)
    monkeypatch.setattr(moe_fp8, "quantize_forward_weights", recording(moe_fp8.quantize_forward_weights))
    moe = _moe_with_fp8(per_step=False)
    out = moe(torch.randn(2, 16, 128)).square().mean()
    assert len(quantized) == 1
    assert len(made) == 2 and all(ref() is None for ref in made)  # freed with the forward's temporaries
    out.backward()
    assert len(quantized) == 2  # backward quantized the dgrad orientation


def test_stale_weights_are_never_used_after_the_refresh() -> None:
    from trainer.parallel.float8 import Fp8ExpertWeightsRefresh

    moe = _moe_with_fp8(per_step=True)
    x = torch.randn(1, 8, 128)
    before = moe(x)
    with torch.no_grad():
        moe.experts.w2.mul_(2.0)  # the optimizer step
    assert torch.equal(moe(x), before)  # within the step the kept FP8 copies serve: the cache is real
    Fp8ExpertWeightsRefresh(moe).after_optimizer_step(1, torch.tensor(False))
    fresh = _moe_with_fp8(per_step=True)  # nothing cached: quantizes the new weights
    fresh.load_state_dict(moe.state_dict())
    # The same routing and the same FP8 arithmetic on the same weights: bit-equal, and not the stale output.
    assert torch.equal(moe(x), fresh(x)) and not torch.equal(moe(x), before)


def test_one_call_converts_linears_and_experts_into_one_report_merged_over_stages(
        caplog: pytest.LogCaptureFixture) -> None:
    """apply_float8 runs the Linears' converter, then the experts': one report, whose lines gain the experts' line
    only where FP8 experts are on; over pipeline stages the Linears and the MoE layers add up."""
    import logging

    from trainer.models import build_model, model_args_for
    from trainer.parallel.float8 import Float8Options, Float8Report, Fp8Experts, apply_float8

    cpu = torch.device("cpu")
    with torch.device("meta"):
        model = build_model(model_args_for("debug_moe"))  # 3 MoE layers after 1 dense one
    with caplog.at_level(logging.INFO, logger="trainer"):
        report = apply_float8(model, Float8Options(recipe="tensorwise", emulate=True, moe_experts="rowwise"),
                              device=cpu)
    assert [type(c) for c in report.converters] == [type(report.linears), Fp8Experts]
    assert report.experts.num_layers == 3 and len(report.experts.modules(model)) == 3
    line = ("routed experts: FP8 rowwise grouped GEMM, layers.*.moe.experts.{w1,w2,w3} x3 (forward and dgrad in "
            "e4m3, wgrad bf16; tokens quantized once before the expert gather, weights quantized in each forward and "
            "backward, none kept)")
    dense = report.linears.lines()
    assert len(dense) == 2 and report.lines() == [*dense, line]
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("trainer")]
    assert logged == [*dense, "float8 matmuls: EMULATED in high precision (float8.emulate=true)", line,
                      "FP8 grouped GEMMs: EMULATED in high precision (float8.emulate=true)"]
    # A stage without MoE layers converts no experts.
    no_moe = Float8Report([dataclasses.replace(report.linears, converted=[], excluded={}, num_linear=0),
                           dataclasses.replace(report.experts, num_layers=0)])
    stages = [report, no_moe, report]
    merged = Float8Report.of_stages(stages)
    n = len(report.linears.converted)
    assert merged.experts.num_layers == 6 and merged.lines()[2] == line.replace(" x3 ", " x6 ")
    assert len(merged.linears.converted) == 2 * n and merged.linears.num_linear == 2 * report.linears.num_linear
    assert merged.stages_lines(stages) == [
        f"FP8 over all 3 pipeline stages ({n}/{report.linears.num_linear}, 0/0, {n}/{report.linears.num_linear} "
        f"converted on stages 0..2): {merged.lines()[1]}",
        f"FP8 over all 3 pipeline stages: {line.replace(' x3 ', ' x6 ')}"]
    assert Float8Report.of_stages([no_moe, no_moe]).lines()[2:] == []
    # float8.moe_experts='off': no experts' converter, and the Linears' lines say the experts stay bf16.
    with torch.device("meta"):
        off = build_model(model_args_for("debug_moe"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        report = apply_float8(off, Float8Options(recipe="tensorwise", emulate=True), device=cpu)
    assert report.experts is None and len(report.lines()) == 2
    assert any(r.getMessage().startswith("MoE routed experts stay bf16: layers.*.moe.experts.{w1,w2,w3} x3")
               for r in caplog.records)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--float8.moe_experts=blockwise"],
         "float8.moe_experts='blockwise' is not available: no Hopper blockwise FP8 grouped GEMM exists"),
        (["--float8.moe_experts=Rowwise"], "float8.moe_experts='Rowwise' is not one of 'off', 'rowwise'"),
        (["--float8.moe_experts=rowwise", "--train.mixed_precision=bf16"],
         "float8.moe_experts='rowwise' applies to fp8 runs only, but train.mixed_precision='bf16'"),
        # debug_model.toml: debug_moe.toml's [moe] keys would have no effect on the dense flavor (an error of its own)
        (["--config", MOE_CONFIG.replace("debug_moe", "debug_model"), "--float8.moe_experts=rowwise",
          "--train.mixed_precision=fp8", "--float8.emulate=true"],
         "float8.moe_experts='rowwise' needs an MoE flavor, but model.flavor='debug'"),
        (["--float8.moe_experts=rowwise", "--train.mixed_precision=fp8"],
         "float8.moe_experts='rowwise' on a machine without CUDA needs float8.emulate=true"),
    ],
)
def test_bad_fp8_expert_configs_are_one_line_naming_the_key(args: list[str], message: str) -> None:
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    if "without CUDA" in message and torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, *args]), world_size=1)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_expert_dims_must_be_multiples_of_16() -> None:
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate.resolve import _check_fp8_experts

    cfg = load_job_config(["--config", MOE_CONFIG, "--train.mixed_precision=fp8", "--float8.emulate=true",
                           "--float8.moe_experts=rowwise"])
    _check_fp8_experts(cfg, MOE_FLAVORS["debug_moe"])
    with pytest.raises(ConfigError, match=r"^float8.moe_experts='rowwise' needs the experts' moe_ffn_dim to be a "
                                          r"multiple of 16 .* has moe_ffn_dim=24$"):
        _check_fp8_experts(cfg, dataclasses.replace(MOE_FLAVORS["debug_moe"], moe_ffn_dim=24))


def test_quantized_expert_weights_are_contiguous_for_the_kernel() -> None:
    """torch._scaled_grouped_mm takes each weight's transpose as mat2 and requires it column-major, i.e. the data
    contiguous; the dgrad orientations are transposes of the weights and must be made contiguous before quantizing
    (on the GPU a transposed data tensor failed with "Expected mat2 to be transposed")."""
    from trainer.models.moe_fp8 import quantize_dgrad_weights, quantize_forward_weights, quantize_rows

    w1, w3 = torch.randn(4, 32, 16), torch.randn(4, 32, 16)
    w2 = torch.randn(4, 16, 32)
    (w13, w2q), (w13_t, w2_t) = quantize_forward_weights(w1, w2, w3), quantize_dgrad_weights(w1, w2, w3)
    for name, (data, scale) in {"w13": w13, "w2": w2q, "w13_t": w13_t, "w2_t": w2_t}.items():
        assert data.is_contiguous(), name
        assert data.transpose(-2, -1).stride()[-2] == 1, name  # column-major mat2
    assert w13_t[0].shape == (4, 16, 64) and w2_t[0].shape == (4, 32, 16)
    # Each orientation is its weight quantized along the GEMM's reduction dim.
    w13_ref = torch.cat([w1, w3], dim=1)
    for got, ref in ((w13, w13_ref), (w2q, w2), (w13_t, w13_ref.transpose(-2, -1)), (w2_t, w2.transpose(-2, -1))):
        want = quantize_rows(ref.contiguous())
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("args, world_size, kept", [
    ([], 1, False),  # one forward per step: each forward and backward quantizes what it uses, nothing is kept
    (["--train.grad_accum_steps=2"], 1, True),  # two forwards per step share one quantization
    (["--train.activation_checkpointing=full"], 1, True),  # the recompute reuses the forward's
    (["--train.grad_accum_steps=2", "--distributed.dp_shard=2"], 2, False),  # FSDP-sharded experts: never pinned
    (["--train.grad_accum_steps=2", "--distributed.dp_shard=2", "--distributed.ep=2"], 2, True),  # one rank each
])
def test_expert_weights_are_kept_only_where_forwards_repeat_and_experts_are_unsharded(
        args: list[str], world_size: int, kept: bool) -> None:
    from trainer.config import load_job_config
    from trainer.validate import validate_job

    cfg = load_job_config(["--config", MOE_CONFIG, "--train.mixed_precision=fp8", "--float8.emulate=true",
                           "--float8.moe_experts=rowwise", *args])
    assert validate_job(cfg, world_size=world_size).build.float8.expert_weights_per_step is kept
