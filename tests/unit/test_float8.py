"""FP8 conversion: which Linears convert, loud guards, and numerics vs bf16 through our build (the log lines and
whole runs against bf16: tests/cli/test_float8.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import DEBUG_CONFIG, fp8_linear_counts
from trainer.models import FLAVORS, Llama
from trainer.parallel.float8 import Float8Options, apply_float8, select_float8_linears

CPU = torch.device("cpu")
DENSE_PROJ = ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def debug_model() -> Llama:
    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    return model


class ToyMoEBlock(nn.Module):
    """Dense attention plus MoE modules named the way MoE models name them."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.attention, name, nn.Linear(64, 64, bias=False))
        self.moe = nn.Module()
        self.moe.router = nn.Linear(64, 8, bias=False)
        self.moe.experts = nn.ModuleList(nn.Linear(64, 128, bias=False) for _ in range(2))
        self.moe.shared_expert = nn.Module()
        self.moe.shared_expert.up_proj = nn.Linear(64, 128, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(64, 128, bias=False)


def fp8(model: nn.Module, *, device: torch.device = CPU, **options):
    """apply_float8 with tensorwise and fp8 all-gather unless `options` say otherwise."""
    options = dict(recipe="tensorwise", enable_fsdp_float8_all_gather=True) | options
    return apply_float8(model, Float8Options(**options), device=device)


def test_dense_model_converts_every_projection_and_the_head(caplog) -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = debug_model()
    with caplog.at_level(logging.INFO, logger="trainer"):
        report = fp8(model)
    n = FLAVORS["debug"].n_layers
    expected = {f"layers.{i}.{p}" for i in range(n) for p in DENSE_PROJ} | {"output_head.proj"}
    assert set(report.linears.converted) == expected
    converted = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == expected
    messages = [r.getMessage() for r in caplog.records]
    assert ("Applied Float8 training: recipe=TENSORWISE, fsdp_float8_all_gather=True, "
            "format=hybrid (e4m3 weights and activations, e5m2 gradients)") in messages
    assert f"converted {len(expected)}/{len(expected)} Linear layers; excluded: none" in messages
    assert report.converted_fraction == 1.0


def test_moe_experts_router_and_shared_experts_stay_bf16() -> None:
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": ToyMoEBlock(), "1": ToyMoEBlock()})
    converted, excluded, num_linear = select_float8_linears(model, exclude_fqns=[])
    assert num_linear == 2 * 9
    assert set(converted) == {f"layers.{i}.attention.{p}_proj" for i in (0, 1) for p in "qkvo"} | {
        "layers.0.mlp.gate_proj", "layers.1.mlp.gate_proj"}
    assert excluded["layers.0.moe.router"] == "MoE router"
    assert excluded["layers.1.moe.experts.1"] == "MoE routed expert"
    assert excluded["layers.0.moe.shared_expert.up_proj"] == "MoE shared expert"


def test_exclusions_typos_and_shapes(caplog) -> None:
    model = debug_model()
    with pytest.raises(ValueError, match=r"float8.exclude_fqns entry 'output_haed.proj' matches no Linear layer"):
        select_float8_linears(model, exclude_fqns=["output_haed.proj"])
    converted, excluded, _ = select_float8_linears(model, exclude_fqns=["output_head.proj", "layers.0.mlp"])
    assert excluded["output_head.proj"] == "float8.exclude_fqns"
    assert {f for f, r in excluded.items() if r == "float8.exclude_fqns"} == {
        "output_head.proj", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"}
    # A dim not divisible by 16 cannot go through torch._scaled_mm: excluded and reported.
    odd = nn.Module()
    odd.attention = nn.Module()
    odd.attention.q_proj = nn.Linear(64, 40, bias=False)
    odd.attention.k_proj = nn.Linear(64, 48, bias=False)
    with caplog.at_level(logging.INFO, logger="trainer"):
        report = fp8(odd)
    assert report.linears.converted == ["attention.k_proj"]
    assert report.linears.excluded == {"attention.q_proj": "shape 64x40 not divisible by 16"}
    assert "converted 1/2 Linear layers; excluded: attention.q_proj (shape 64x40 not divisible by 16)" in [
        r.getMessage() for r in caplog.records]


def test_exclusion_line_names_exactly_what_was_excluded(caplog) -> None:
    # Excluding layers.0 must not read as "every layer's k_proj" (layers.*.attention.k_proj).
    with caplog.at_level(logging.INFO, logger="trainer"):
        fp8(debug_model(), exclude_fqns=["layers.0", "output_head.proj"])
    converted, linears = fp8_linear_counts(FLAVORS["debug"])
    counts = f"converted {converted - 8}/{linears} Linear layers"  # less layers.0's seven and the head
    assert (counts + "; excluded: layers.0.{attention.q_proj,attention.k_proj,"
            "attention.v_proj,attention.o_proj,mlp.gate_proj,mlp.up_proj,mlp.down_proj}, output_head.proj "
            "(float8.exclude_fqns)") in [r.getMessage() for r in caplog.records]


def test_group_fqns_is_exact_and_compact() -> None:
    from trainer.parallel.float8 import group_fqns

    assert group_fqns([]) == []
    assert group_fqns(["output_head.proj"]) == ["output_head.proj"]
    # Layers holding the same names share one entry; index runs of 3+ are ranges.
    moe = [f"layers.{i}.moe.{n}" for i in (0, 1, 2, 3, 7) for n in ("router", "experts.0", "experts.1")]
    assert group_fqns(moe) == ["layers.{0..3,7}.{moe.router,moe.experts.0,moe.experts.1}"]
    # Different names under different layers stay apart, in model order.
    assert group_fqns(["layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "layers.2.mlp.up_proj",
                       "output_head.proj"]) == [
        "layers.0.{mlp.up_proj,mlp.down_proj}", "layers.2.mlp.up_proj", "output_head.proj"]


def test_state_dict_keys_and_values_do_not_depend_on_conversion() -> None:
    plain, converted = debug_model(), debug_model()
    fp8(converted)
    a, b = plain.state_dict(), converted.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain.load_state_dict(b)  # and they load into each other
    converted.load_state_dict(a)


def test_gpu_without_fp8_warns_loudly_or_fails(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    gpu = torch.device("cuda", 0)
    model = debug_model()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        report = fp8(model, device=gpu)
    assert not report.enabled and not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "FP8 IS UNAVAILABLE ON THIS GPU" in text and "compute capability 8.0" in text and "BF16 instead" in text
    with pytest.raises(ValueError, match="float8.require=true, so stopping"):
        fp8(debug_model(), device=gpu, require=True)


def test_tensor_parallel_weights_are_an_invariant_not_a_second_refusal() -> None:
    """FP8 + TP is refused once, by the config check (tests/unit/test_config.py); below it apply_float8 asserts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = debug_model()
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"layers.0.attention.q_proj": ColwiseParallel()})
        with pytest.raises(AssertionError, match=r"^layers\.0\.attention\.q_proj\.weight is a tensor-parallel DTensor: "
                           "JobConfig refuses FP8 \\+ tensor parallelism"):
            fp8(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("setting, recipe, world, expected", [
    ("auto", "tensorwise", 1, False), ("auto", "tensorwise", 2, True), ("auto", "rowwise", 2, False),
    ("true", "tensorwise", 1, True), ("false", "tensorwise", 2, False),
])
def test_fp8_all_gather_auto_is_on_only_where_fsdp_shards_tensorwise_weights(setting, recipe, world, expected):
    from trainer.config import load_job_config
    from trainer.validate import validate_job

    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8", f"--float8.recipe={recipe}",
                           f"--float8.enable_fsdp_float8_all_gather={setting}"])
    assert validate_job(cfg, world_size=world).build.float8.enable_fsdp_float8_all_gather is expected


@pytest.mark.slow
def test_fp8_model_close_to_bf16_through_our_build_on_cpu() -> None:
    """The GPU test's check (tests/gpu) on CPU's real _scaled_mm path, at debug shapes."""
    from tests.gpu.test_gpu import fp8_vs_bf16, grad_rel_err

    runs = fp8_vs_bf16("debug", n_layers=2, batch_size=4, seq_len=64)
    bf16, fp8, emulated = runs["bf16"], runs["fp8"], runs["fp8_emulated"]
    assert fp8["report"].converted_fraction == 1.0 and len(fp8["float8_linears"]) == 2 * 7 + 1
    assert fp8["loss"] != bf16["loss"] and fp8["loss"] == pytest.approx(bf16["loss"], rel=1e-2)
    fp8_err, emulated_err = grad_rel_err(fp8["grads"], bf16["grads"]), grad_rel_err(emulated["grads"], bf16["grads"])
    assert 0 < fp8_err < 0.5 and fp8_err < 1.25 * emulated_err, (fp8_err, emulated_err)


@pytest.mark.parametrize("fp8_format, gradient_dtype", [("hybrid", torch.float8_e5m2), ("e4m3", torch.float8_e4m3fn)])
def test_float8_format_picks_the_gradients_fp8_type(fp8_format: str, gradient_dtype: torch.dtype, caplog) -> None:
    """float8.format (tensorwise): every torch._scaled_mm of the forward takes e4m3 operands; in backward the
    gradient operand is e5m2 under 'hybrid' (torchao's default) and e4m3 under 'e4m3'. Read from the float8
    tensors the GEMMs were given, not from the config."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScaledMatmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[set[torch.dtype]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # torchao's float8 tensors reach the mode as aten.mm of two Float8TrainingTensors (their fp8 `_data`),
            # which their own dispatch then runs as torch._scaled_mm.
            if func in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default) and hasattr(args[0], "_data"):
                self.dtypes.append({args[0]._data.dtype, args[1]._data.dtype})
            return func(*args, **(kwargs or {}))

    model = debug_model().to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="trainer"):
        fp8(model, format=fp8_format)
    words = "hybrid (e4m3 weights and activations, e5m2 gradients)" if fp8_format == "hybrid" else "e4m3 everywhere"
    assert any(f"format={words}" in r.message for r in caplog.records)
    tokens = torch.randint(0, 512, (2, 33))
    forward, backward = ScaledMatmuls(), ScaledMatmuls()
    with forward:
        loss = torch.nn.functional.cross_entropy(model.logits(tokens[:, :-1]).flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
    with backward:
        loss.backward()
    assert forward.dtypes and all(d == {torch.float8_e4m3fn} for d in forward.dtypes)
    assert backward.dtypes and all(gradient_dtype in d for d in backward.dtypes)  # every backward GEMM takes a grad
    if fp8_format == "e4m3":
        assert all(d == {torch.float8_e4m3fn} for d in backward.dtypes)


def test_float8_format_resolves_per_recipe() -> None:
    from trainer.config import ConfigError, load_job_config
    from trainer.validate import validate_job

    def resolved(*argv: str) -> str:
        job = validate_job(load_job_config(["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8", *argv]),
                           world_size=1)
        return job.build.float8.format

    assert resolved() == "hybrid" and resolved("--float8.format=e4m3") == "e4m3"
    assert resolved("--float8.recipe=rowwise", "--float8.emulate=true") == "e4m3"
    with pytest.raises(ConfigError, match=r"^float8.format='hybrid' \(e5m2 gradients\) is the tensorwise recipe's"):
        load_job_config(["--train.mixed_precision=fp8", "--float8.recipe=rowwise", "--float8.format=hybrid"])


def test_fp8_unavailable_is_decided_once_by_validation(monkeypatch) -> None:
    """Where the probe finds no FP8 matmul (here: a device said to lack it), the validation pass records why, and
    what it hands down says bf16: no Linear converted in float8_layers, the memory plan a bf16 run's, the precision
    line 'NO FP8'. float8.require turns the same finding into the one-line error."""
    import dataclasses

    import trainer.validate.resolve as resolve
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate.run_files import describe_precision
    from trainer.validate import validate_job

    monkeypatch.setattr(resolve, "fp8_supported", lambda device, recipe="tensorwise": (False, "no FP8 here (a test)"))
    argv = ["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8"]
    job = validate_job(load_job_config(argv), world_size=1)
    assert job.build.float8.unavailable == "no FP8 here (a test)"
    assert "converted" not in job.float8_layers.values()
    bf16 = validate_job(load_job_config([*argv[:-1], "--train.mixed_precision=bf16"]), world_size=1)
    assert job.memory_plan.peak_bytes == bf16.memory_plan.peak_bytes
    line = describe_precision(mixed_precision="fp8", bf16_update="stochastic", build=job.build,
                              float8_layers=job.float8_layers)
    assert "NO FP8: tensorwise FP8 is unavailable on this device, every Linear layer runs in bfloat16" in line
    assert "matmuls in" not in line
    # Routed experts whose FP8 grouped GEMM cannot run: the line says they run in bf16, not FP8 grouped GEMMs.
    experts = dataclasses.replace(job.build, float8=dataclasses.replace(
        job.build.float8, unavailable="", moe_experts="rowwise", experts_unavailable="sm80"))
    line = describe_precision(mixed_precision="fp8", bf16_update="stochastic", build=experts, float8_layers={})
    assert "routed experts in bfloat16 (FP8 grouped GEMMs unavailable on this device)" in line
    assert "grouped GEMMs in the routed experts" not in line
    with pytest.raises(ConfigError, match="with float8.require=true, but .*no FP8 here"):
        validate_job(load_job_config([*argv, "--float8.require=true"]), world_size=1)
