"""validation.mixed_precision='bf16': an fp8 model evaluates with bf16 matmuls (the same weights), eagerly and
compiled, without recompiling at every evaluation; the config refuses what it cannot do (whole runs:
tests/cli/test_evaluate.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from tests.unit.test_float8 import debug_model, fp8
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.models import FLAVORS, Llama
from trainer.parallel.compile import apply_compile
from trainer.parallel.float8 import Float8Report, bf16_matmuls, is_float8_linear

TOKENS = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))


def models() -> tuple[Llama, Llama, Float8Report]:
    """(the debug model in bf16, a copy with its projections and head converted to fp8 tensorwise, its report)."""
    plain = debug_model().to(torch.bfloat16)
    converted = copy.deepcopy(plain)
    report = fp8(converted, enable_fsdp_float8_all_gather=False)
    return plain, converted, report


@torch.no_grad()
def test_bf16_matmuls_compute_exactly_as_the_unconverted_model_and_restore_fp8():
    plain, converted, report = models()
    linear_types = {fqn: type(m) for fqn, m in converted.named_modules() if is_float8_linear(m)}
    assert len(linear_types) == 7 * FLAVORS["debug"].n_layers + 1
    reference = plain.logits(TOKENS)
    fp8_logits = converted.logits(TOKENS)
    with bf16_matmuls(converted, report) as switched:
        assert switched == len(linear_types)
        assert not any(is_float8_linear(m) for m in converted.modules())
        # The same weights through the same F.linear calls: bit for bit the bf16 model.
        assert torch.equal(converted.logits(TOKENS), reference)
    assert {fqn: type(m) for fqn, m in converted.named_modules() if is_float8_linear(m)} == linear_types
    # Outside the context the matmuls are fp8 again: their logits, not the bf16 ones.
    assert torch.equal(converted.logits(TOKENS), fp8_logits)
    assert not torch.equal(fp8_logits, reference)


@torch.no_grad()
def test_fp8_routed_experts_evaluate_with_the_bf16_grouped_gemm():
    from trainer.models import build_model, model_args_for
    from trainer.models.moe_experts import GroupedSwiGLU
    from trainer.parallel.float8 import experts_modules

    plain = build_model(model_args_for("debug_moe"))
    plain.init_weights(seed=0)
    plain.to(torch.bfloat16)
    converted = copy.deepcopy(plain)
    report = fp8(converted, enable_fsdp_float8_all_gather=False, emulate=True, moe_experts="rowwise")
    kernels = {fqn: m.kernel for fqn, m in experts_modules(converted).items()}
    assert len(kernels) == 3 and not any(isinstance(k, GroupedSwiGLU) for k in kernels.values())
    reference, fp8_logits = plain.logits(TOKENS), converted.logits(TOKENS)
    with bf16_matmuls(converted, report) as switched:
        assert switched == len(report.linears.converted) + len(kernels)
        assert torch.equal(converted.logits(TOKENS), reference)
    assert {fqn: m.kernel for fqn, m in experts_modules(converted).items()} == kernels
    assert torch.equal(converted.logits(TOKENS), fp8_logits) and not torch.equal(fp8_logits, reference)


@pytest.mark.slow  # about 35 s of CPU compiles
def test_compiled_blocks_evaluate_in_bf16_and_compile_for_it_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    plain, converted, report = models()
    apply_compile(plain, context_parallel=False)
    apply_compile(converted, context_parallel=False)
    with torch.no_grad():
        reference = plain.eval().logits(TOKENS)

    def train_and_evaluate() -> torch.Tensor:
        converted.train()
        converted.logits(TOKENS).float().square().mean().backward()  # a training step's forward and backward
        converted.eval()
        with torch.no_grad(), bf16_matmuls(converted, report):
            return converted.logits(TOKENS)

    assert torch.equal(train_and_evaluate(), reference)  # the same compiled graph as the bf16 model's
    compiles = counters["stats"]["unique_graphs"]
    for _ in range(2):
        assert torch.equal(train_and_evaluate(), reference)
    assert counters["stats"]["unique_graphs"] == compiles, "an evaluation recompiled the blocks"


@pytest.mark.parametrize("override, message", [
    (["--train.mixed_precision=fp32"], "train.mixed_precision trains in fp32, which it would not evaluate in bf16"),
    (["--train.mixed_precision=fp16"], "train.mixed_precision trains in fp16"),
    (["--train.mixed_precision=bf16", "--train.precision_schedule=fp32:2,fp8", "--train.steps=4",
      "--checkpoint.enable=true"],
     "train.precision_schedule trains in fp32"),
    (["--train.mixed_precision=fp8", "--float8.enable_fsdp_float8_all_gather=true"],
     "float8.enable_fsdp_float8_all_gather=true gathers float8 ones"),
])
def test_what_bf16_evaluation_cannot_do_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_job_config(["--config", DEBUG_CONFIG, "--validation.mixed_precision=bf16", *override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bf16_evaluation_turns_auto_fp8_all_gather_off(caplog):
    from trainer.validate import validate_job

    args = ["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8", "--float8.emulate=true",
            "--validation.enable=true", "--distributed.dp_shard=2"]
    on = validate_job(load_job_config(args), world_size=2)
    assert on.build.float8.enable_fsdp_float8_all_gather
    with caplog.at_level("INFO", logger="trainer"):
        off = validate_job(load_job_config([*args, "--validation.mixed_precision=bf16"]), world_size=2)
    assert not off.build.float8.enable_fsdp_float8_all_gather
    assert "validation.mixed_precision='bf16'" in caplog.text
