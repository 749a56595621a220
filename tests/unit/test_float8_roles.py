"""Precision per block and per GEMM role (docs/fp8.md#precision-per-block-and-per-gemm): float8.bf16_first_blocks /
bf16_last_blocks against a bf16 model's blocks, float8.forward / float8.backward against a bf16 nn.Linear and the
all-FP8 Linear, for every Linear recipe, and the refusals. Several ranks: tests/distributed/test_float8_roles.py."""

from __future__ import annotations

import copy
import json
import dataclasses
import logging

import pytest
import torch
from torch import nn

from tests.helpers import DEBUG_CONFIG, REPO
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.models import FLAVORS, Llama
from trainer.models.moe import MOE_FLAVORS, MoE
from trainer.models.moe_experts import ExpertRows, GroupedSwiGLU
from trainer.models.moe_fp8 import Fp8ExpertWeights, Fp8GroupedSwiGLU, Fp8RolesSwiGLU
from trainer.models.moe_permute import inverse_permutation
from trainer.parallel.float8 import Float8Options, apply_float8
from trainer.validate import validate_job
from trainer.validate.float8_roles import all_gather_with_roles
from trainer.validate.run_files import describe_precision

CPU = torch.device("cpu")
# (recipe, emulate): torchao's recipes also on aten's CPU torch._scaled_mm (the real FP8 GEMM path); blockwise's
# real kernels are CUDA's.
RECIPES = [("tensorwise", True), ("rowwise", True), ("rowwise_with_gw_hp", True), ("blockwise", True),
           ("tensorwise", False), ("rowwise", False), ("rowwise_with_gw_hp", False)]


@pytest.fixture(autouse=True)
def aten_scaled_mm():
    before = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = before


def one_linear(recipe: str, forward: str, backward: str, *, emulate: bool = True) -> nn.Module:
    """A model holding one converted projection (256 x 256: blockwise needs multiples of 128), bf16."""
    torch.manual_seed(0)
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.up_proj = nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    if forward or backward:
        report = apply_float8(model, Float8Options(recipe=recipe, emulate=emulate, forward=forward or "fp8",
                                                   backward=backward or "fp8"), device=CPU)
        assert report.linears.converted == ["mlp.up_proj"]
    return model


def run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = model.mlp.up_proj(x)
    out.backward(grad)
    return out, x.grad, model.mlp.up_proj.weight.grad


@pytest.mark.parametrize("recipe, emulate", RECIPES)
def test_bf16_backward_gives_the_bf16_linears_gradients(recipe: str, emulate: bool) -> None:
    """float8.backward='bf16': the FP8 forward's output, and exactly the gradients a bf16 nn.Linear computes from the
    same input, weight and output gradient (the forward's FP8 casts are not reused)."""
    torch.manual_seed(1)
    x, grad = torch.randn(2, 96, 256, dtype=torch.bfloat16), torch.randn(2, 96, 256, dtype=torch.bfloat16)
    out, gx, gw = run(one_linear(recipe, "fp8", "bf16", emulate=emulate), x, grad)
    out8, gx8, gw8 = run(one_linear(recipe, "fp8", "fp8", emulate=emulate), x, grad)
    out16, gx16, gw16 = run(one_linear(recipe, "", ""), x, grad)
    assert torch.equal(out, out8) and not torch.equal(out, out16)  # the forward is the FP8 one
    assert torch.equal(gx, gx16) and torch.equal(gw, gw16)
    assert not torch.equal(gx8, gx16)  # FP8 backward would differ: the comparison has teeth


@pytest.mark.parametrize("recipe, emulate", RECIPES)
def test_bf16_forward_gives_the_bf16_output_and_the_fp8_gradients(recipe: str, emulate: bool) -> None:
    """float8.forward='bf16': a bf16 nn.Linear's output, and the all-FP8 Linear's gradients (cast from the same
    bf16 input and weight in backward)."""
    torch.manual_seed(2)
    x, grad = torch.randn(160, 256, dtype=torch.bfloat16), torch.randn(160, 256, dtype=torch.bfloat16)
    out, gx, gw = run(one_linear(recipe, "bf16", "fp8", emulate=emulate), x, grad)
    out8, gx8, gw8 = run(one_linear(recipe, "fp8", "fp8", emulate=emulate), x, grad)
    out16, gx16, _ = run(one_linear(recipe, "", ""), x, grad)
    assert torch.equal(out, out16)
    assert torch.equal(gx, gx8) and torch.equal(gw, gw8) and not torch.equal(gx, gx16)


def test_roles_in_the_startup_line_and_fp8_layers_json(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="trainer"):
        one_linear("rowwise", "bf16", "fp8")
    assert any("recipe=ROWWISE" in r.getMessage() and "forward=BF16, backward=FP8 (dgrad and wgrad)" in r.getMessage()
               for r in caplog.records)


def cfg(*overrides: str):
    return load_job_config(["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8", "--float8.emulate=true",
                            *overrides])


@pytest.mark.parametrize(("overrides", "message"), [
    (["--float8.forward=bf16", "--float8.backward=bf16"], "float8.forward='bf16', float8.backward='bf16' leaves no GEMM"),
    (["--float8.backward=bf16", "--float8.scaling=delayed"], "float8.scaling='delayed' keeps amax histories"),
    (["--float8.forward=bf16", "--float8.save_fp8_activations=true"], "float8.save_fp8_activations=true saves"),
    (["--float8.forward=bf16", "--float8.enable_fsdp_float8_all_gather=true"],
     "float8.enable_fsdp_float8_all_gather=true gathers float8 weights"),
    (["--float8.bf16_first_blocks=-1"], "float8.bf16_first_blocks=-1 must be >= 0"),
    (["--float8.bf16_first_blocks=3", "--float8.bf16_last_blocks=2"],
     "float8.bf16_first_blocks=3 + float8.bf16_last_blocks=2 name more blocks than the model's 4"),
    (["--float8.exclude_fqns=layers.0."], "float8.exclude_fqns entry 'layers.0.' must be whole dotted segments"),
])
def test_meaningless_combinations_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate_job(cfg(*overrides), world_size=1)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_fp8_dispatch_into_bf16_forward_experts_is_one_line() -> None:
    moe = load_job_config(["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), "--train.mixed_precision=fp8",
                           "--float8.emulate=true", "--distributed.ep=2", "--moe.dispatch_dtype=fp8",
                           "--float8.forward=bf16"])
    with pytest.raises(ConfigError) as e:
        validate_job(moe, world_size=2)
    assert str(e.value).startswith("moe.dispatch_dtype='fp8' sends FP8-rounded tokens to FP8 expert GEMMs; with "
                                   "float8.forward='bf16'")


def test_auto_all_gather_turns_off_with_a_bf16_role() -> None:
    assert all_gather_with_roles(cfg(), True)
    assert not all_gather_with_roles(cfg("--float8.backward=bf16"), True)


def test_bf16_blocks_are_named_with_their_reason(tmp_path) -> None:
    job = validate_job(cfg("--float8.bf16_first_blocks=1", "--float8.bf16_last_blocks=1",
                           f"--job.dump_folder={tmp_path}"), world_size=1)
    layers = job.float8_layers
    assert layers["layers.0.attention.q_proj"] == "float8.bf16_first_blocks=1"
    assert layers["layers.3.mlp.down_proj"] == "float8.bf16_last_blocks=1"
    assert layers["layers.1.mlp.down_proj"] == layers["layers.2.attention.q_proj"] == "converted"
    assert layers["output_head.proj"] == "converted"
    assert dict(job.build.float8.bf16_blocks) == {0: "float8.bf16_first_blocks=1", 3: "float8.bf16_last_blocks=1"}
    fp8_layers = json.loads(dict(job.run_files)["fp8_layers.json"])
    assert fp8_layers["bf16_blocks"] == {"layers.0": "float8.bf16_first_blocks=1", "layers.3": "float8.bf16_last_blocks=1"}
    assert fp8_layers["layers"]["layers.0.mlp.up_proj"] == "float8.bf16_first_blocks=1"
    assert "forward" not in fp8_layers  # both roles fp8: said only where one is bf16
    assert "FP8 tensorwise matmuls in 15 Linear layers (EMULATED, hybrid: e5m2 gradients, blocks layers.0, layers.3 " \
           "in bf16)" in precision_line(job)


def test_fp8_layers_json_names_the_roles(tmp_path) -> None:
    job = validate_job(cfg("--float8.backward=bf16", "--float8.recipe=rowwise", f"--job.dump_folder={tmp_path}"),
                       world_size=1)
    fp8_layers = json.loads(dict(job.run_files)["fp8_layers.json"])
    assert (fp8_layers["forward"], fp8_layers["backward"]) == ("fp8", "bf16")
    assert "bf16_blocks" not in fp8_layers
    assert "(EMULATED, e4m3: e4m3 everywhere, FP8 forward only)" in precision_line(job)


def precision_line(job) -> str:
    return describe_precision(mixed_precision=job.run.mixed_precision, bf16_update=job.optimizer.bf16_update,
                              build=job.build, float8_layers=job.float8_layers)


def test_bf16_blocks_are_bit_identical_to_a_bf16_models_blocks(caplog) -> None:
    """The first and last blocks of an fp8 model with bf16_first_blocks=1, bf16_last_blocks=1 compute exactly what a
    bf16 model's blocks compute from the same input, forward and backward; a converted block does not."""
    args = FLAVORS["debug"]
    bf16 = Llama(args)
    bf16.init_weights(seed=0)
    bf16 = bf16.to(torch.bfloat16)
    model = copy.deepcopy(bf16)
    blocks = {0: "float8.bf16_first_blocks=1", 3: "float8.bf16_last_blocks=1"}
    with caplog.at_level(logging.INFO, logger="trainer"):
        apply_float8(model, Float8Options(recipe="tensorwise", emulate=True, bf16_blocks=tuple(blocks.items())),
                     device=CPU)
    assert any("layers.0.{" in r.getMessage() and "(float8.bf16_first_blocks=1)" in r.getMessage()
               for r in caplog.records)
    torch.manual_seed(3)
    h = torch.randn(2, 16, args.dim, dtype=torch.bfloat16)
    grad = torch.randn_like(h)
    for i, same in ((0, True), (1, False), (3, True)):
        results = []
        for m in (model, bf16):
            x = h.clone().requires_grad_()
            out = m.layers[str(i)](x, m.rope)
            out.backward(grad)
            results.append((out, x.grad, *(p.grad for p in m.layers[str(i)].parameters())))
        equal = all(torch.equal(a, b) for a, b in zip(*results))
        assert equal == same, i


def moe_layer(kernel) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dataclasses.replace(MOE_FLAVORS["debug_moe"], n_shared_experts=0))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    if kernel is not None:
        moe.experts.use(kernel=kernel)
    return moe


def expert_kernel_run(kernel, forward_probe: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One kernel call on 40 tokens (k = 2 of 5 experts, one without rows): its output and the gradients of
    (output * probe).sum() for source rows and weights; the probe is the output itself unless given."""
    torch.manual_seed(0)
    n_tokens, k, n_experts, dim, hidden = 40, 2, 5, 32, 48
    x = torch.randn(n_tokens, dim, requires_grad=True)
    w1, w3 = ((0.1 * torch.randn(n_experts, hidden, dim)).requires_grad_() for _ in range(2))
    w2 = (0.1 * torch.randn(n_experts, dim, hidden)).requires_grad_()
    experts = torch.randint(0, n_experts - 1, (n_tokens * k,), generator=torch.Generator().manual_seed(1)) + 1
    order = torch.argsort(experts, stable=True)
    rows = ExpertRows(x, order // k, inverse_permutation(order), torch.bincount(experts, minlength=n_experts), k)
    out = kernel(rows, w1, w2, w3)
    probe = out.detach() if forward_probe is None else forward_probe
    (out * probe).sum().backward()
    return [out.detach(), x.grad, w1.grad, w2.grad, w3.grad]


@pytest.mark.parametrize(("forward", "backward"), [("fp8", "bf16"), ("bf16", "fp8")])
def test_fp8_experts_roles_take_each_direction_from_its_kernel(forward: str, backward: str) -> None:
    """The FP8 experts with a bf16 role: the forward role's kernel's output exactly, and exactly the gradients the
    backward role's kernel gives for the same output gradient (its FP8 or bf16 weights and rows, never the other's)."""
    kernels = {"fp8": lambda: Fp8GroupedSwiGLU(Fp8ExpertWeights(per_step=False), emulate=True),
               "bf16": GroupedSwiGLU}
    roles = expert_kernel_run(Fp8RolesSwiGLU(Fp8ExpertWeights(per_step=False), emulate=True, forward=forward,
                                             backward=backward))
    assert torch.equal(roles[0], expert_kernel_run(kernels[forward]())[0])
    want = expert_kernel_run(kernels[backward](), forward_probe=roles[0])
    assert all(torch.equal(a, b) for a, b in zip(roles[1:], want[1:]))
    other = expert_kernel_run(kernels[forward](), forward_probe=roles[0])  # the other kernel's differ
    assert not torch.equal(other[2], roles[2])


def test_fp8_experts_converter_installs_the_roles_kernel(caplog) -> None:
    moe = moe_layer(None)
    with caplog.at_level(logging.INFO, logger="trainer"):
        report = apply_float8(moe, Float8Options(recipe="tensorwise", emulate=True, moe_experts="rowwise",
                                                 backward="bf16"), device=CPU)
    assert isinstance(moe.experts.kernel, Fp8RolesSwiGLU) and report.experts.num_layers == 1
    assert any("forward in e4m3; backward bf16" in r.getMessage() for r in caplog.records)


def test_last_blocks_are_the_main_models_not_deepseek_v3s_mtp_module() -> None:
    """DeepSeek-V3 keeps its MTP module in `layers` after the n_layers blocks (layers.2 of 2 here): bf16_last_blocks
    counts the model's blocks, so the MTP module converts as the flavor has it."""
    from trainer.models.deepseek_v3 import FLAVORS as DSV3, DeepseekV3
    from trainer.validate.float8_roles import resolve_bf16_blocks

    args = dataclasses.replace(DSV3["debug_deepseek_v3"], n_layers=2, max_seq_len=32)
    model = DeepseekV3(args)
    model.init_weights(seed=0)
    blocks = resolve_bf16_blocks(cfg("--float8.bf16_last_blocks=1"), args.n_layers)
    report = apply_float8(model, Float8Options(recipe="tensorwise", emulate=True, bf16_blocks=tuple(blocks.items())),
                          device=CPU)
    assert report.linears.excluded["layers.1.attention.o_proj"] == "float8.bf16_last_blocks=1"
    assert {"layers.2.eh_proj", "layers.2.attention.o_proj", "layers.0.attention.o_proj"} <= set(
        report.linears.converted)
