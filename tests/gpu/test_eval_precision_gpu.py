"""validation.mixed_precision='bf16' on a GPU: compiled fp8 blocks (real torch._scaled_mm) evaluate with bf16 matmuls,
bit for bit the unconverted compiled bf16 model, and compile for it once (the CPU check with aten's fp8 kernel:
tests/unit/test_eval_precision.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.models import FLAVORS, Llama
from trainer.parallel.compile import apply_compile
from trainer.parallel.float8 import Float8Options, apply_float8, bf16_matmuls, is_float8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_compiled_fp8_blocks_evaluate_in_bf16_exactly_and_compile_once() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    cuda = torch.device("cuda")
    with cuda:
        plain = Llama(FLAVORS["debug"])
    plain.init_weights(seed=0)
    plain.to(torch.bfloat16)
    converted = copy.deepcopy(plain)
    report = apply_float8(converted, Float8Options(recipe="tensorwise", require=True), device=cuda)
    fqns = report.linears.converted
    assert fqns and sum(is_float8_linear(m) for m in converted.modules()) == len(fqns)
    apply_compile(plain, context_parallel=False)
    apply_compile(converted, context_parallel=False)
    tokens = torch.randint(0, FLAVORS["debug"].vocab_size, (4, 256), device=cuda,
                           generator=torch.Generator(cuda).manual_seed(0))
    with torch.no_grad():
        reference = plain.eval().logits(tokens)
        fp8_logits = converted.eval().logits(tokens)
    assert not torch.equal(fp8_logits, reference)

    def train_and_evaluate() -> torch.Tensor:
        converted.train()
        converted.logits(tokens).float().square().mean().backward()
        converted.eval()
        with torch.no_grad(), bf16_matmuls(converted, report):
            return converted.logits(tokens)

    assert torch.equal(train_and_evaluate(), reference)
    compiles = counters["stats"]["unique_graphs"]
    for _ in range(2):
        assert torch.equal(train_and_evaluate(), reference)
    assert counters["stats"]["unique_graphs"] == compiles, "an evaluation recompiled the blocks"
    with torch.no_grad():
        assert torch.equal(converted.logits(tokens), fp8_logits)  # fp8 again outside the context
