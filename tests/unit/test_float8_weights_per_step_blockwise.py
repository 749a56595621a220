"""float8.weights_per_step under float8.recipe='blockwise' (trainer.parallel.float8.blockwise): each Linear's 128x128
weight cast made once per step, the very bytes and scales torchao's kernel makes, serves every microbatch's forward,
input-gradient GEMM and activation-checkpoint recompute, bit for bit what casting per use computes; the next step
casts the new weights; the config, the memory plan's row and a whole run on the debug model. Tensorwise:
tests/unit/test_float8_weights_per_step.py; 2 ranks: tests/distributed/test_float8_weights_per_step.py."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.unit.test_float8_weights_per_step import (
    ARGS, assert_compiled_bit_equal_and_compiles_once, losses_and_casts,
)
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.parallel.float8.blockwise import BLOCK, BlockwiseFloat8Linear, convert_to_blockwise

BLOCKWISE = [*ARGS, "--float8.recipe=blockwise"]


class Block(nn.Module):
    """Two Linears (dims multiples of 128) behind full activation checkpointing, as the model's blocks are."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(128, 256, bias=False), nn.Linear(256, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(lambda h: self.down(torch.relu(self.up(h))), x, use_reentrant=False)


def count_weight_casts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every 128x128 cast of a weight (the emulation's one quantizer, at the weights' grouping), by shape."""
    import trainer.parallel.float8.blockwise as blockwise

    casts, quantize = [], blockwise.quantize_blocks

    def counting(t, group):
        if group == (BLOCK, BLOCK):
            casts.append(tuple(t.shape))
        return quantize(t, group)

    monkeypatch.setattr(blockwise, "quantize_blocks", counting)
    return casts


def two_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block()).to(torch.bfloat16)
    convert_to_blockwise(base, {"0.up", "0.down", "1.up", "1.down"}, emulate=True)
    return base, copy.deepcopy(base)


def test_grad_accumulation_is_bit_equal_with_one_cast_per_weight_per_step(monkeypatch) -> None:
    """4 microbatches of 160 tokens (padded to 256 inside the layer) per step under full AC, 3 steps of SGD: every
    output and gradient bit-equal to casting per use; per step each weight is cast once (the hook) where per use
    costs 4 x (forward, recompute, input-gradient GEMM) = 12; each step's kept cast is of that step's weights (a stale
    one would break step 2's equality), and it is torchao's reference quantization of them, bytes and scales."""
    from torchao.prototype.blockwise_fp8_training.kernels import torch_blockwise_scale_weight_quant

    from trainer.parallel.float8.weights_per_step import Fp8WeightsPerStep, kept_linears

    per_use, per_step = two_models()
    keep = Fp8WeightsPerStep(per_step, dtype=torch.bfloat16)
    numel = 4 * 128 * 256
    assert len(keep.linears) == 4 and keep.nbytes == numel + 4 * (numel // (128 * 128))  # 1 B each, fp32 per block
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (per_use, per_step)]
    casts = count_weight_casts(monkeypatch)
    kept_before = None
    for step in (1, 2, 3):
        counts, outs = [], {}
        for model, uses_cache in ((per_use, False), (per_step, True)):
            casts.clear()
            with keep.step_context(step) if uses_cache else torch.enable_grad():
                kept = [m.fp8_weight for m in kept_linears(model).values()] if uses_cache else None
                outs[uses_cache] = []
                for micro in range(4):
                    x = torch.randn(2, 80, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(micro))
                    out = model(x * step)
                    (out.float() ** 2).mean().backward()
                    outs[uses_cache].append(out)
                if uses_cache:
                    keep.after_forward_backward(step)
                    assert all(m.fp8_weight is None for m in keep.linears)  # gone before the optimizer step
            counts.append(len(casts))
        assert counts == [4 * 12, 4]  # four weights: 12 casts each per use, one each per step
        for m, (q, inv) in zip(kept_linears(per_step).values(), kept):
            want_q, want_inv = torch_blockwise_scale_weight_quant(m.weight.detach())
            assert q.dtype == torch.float8_e4m3fn and q.shape == m.weight.shape and q.is_contiguous()
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(inv, want_inv)
        kept_data = [q.view(torch.uint8) for q, _ in kept]
        if kept_before is not None:  # the new weights' cast, not the last step's
            assert not any(torch.equal(a, b) for a, b in zip(kept_data, kept_before))
        kept_before = kept_data
        for a, b in zip(outs[False], outs[True]):
            assert torch.equal(a, b)
        for a, b in zip(per_use.parameters(), per_step.parameters()):
            assert torch.equal(a.grad, b.grad)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def test_nothing_is_kept_outside_a_step() -> None:
    """Inside a step its forwards multiply the kept cast (weights changed in place do not show); after it the
    Linears cast what they multiply again."""
    from trainer.parallel.float8.weights_per_step import Fp8WeightsPerStep

    _, model = two_models()
    keep = Fp8WeightsPerStep(model, dtype=torch.bfloat16)
    x = torch.randn(1, 128, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
        with keep.step_context(1):
            for p in model.parameters():
                p.mul_(2.0)  # only the optimizer changes weights, after forward/backward: here to see the cache
            assert torch.equal(model(x), before)
        assert not torch.equal(model(x), before)
    assert all(m.fp8_weight is None for m in keep.linears)


@pytest.mark.slow  # inductor codegen of a toy model, twice
def test_compiled_reads_the_kept_casts_as_inputs_bit_equal_and_compiles_once() -> None:
    """torch.compile(fullgraph=True) over the blocks under full AC: the kept casts (made eagerly) are graph inputs;
    3 steps of 2 microbatches give the uncached compiled run's outputs and gradients bit for bit, and the cached
    model compiles one graph for all steps (no recompile when the next step's casts arrive)."""
    per_use, per_step = two_models()
    assert_compiled_bit_equal_and_compiles_once(per_use, per_step, input_shape=(1, 128, 128))


def test_on_keeps_blockwise_casts_with_the_memory_plan_row_and_rowwise_is_refused(monkeypatch) -> None:
    """'on' runs blockwise (4 microbatches share each cast); the row counts 1 byte per converted weight element and
    4 per 128x128 block; rowwise (two different casts of the weight) is refused in one line naming the key."""
    from trainer.validate import validate_job

    job = validate_job(load_job_config([*BLOCKWISE, "--float8.weights_per_step=on"]), world_size=1)
    f8 = job.build.float8
    assert f8.weights_per_step == 4 and f8.kept_weight_numel % (128 * 128) == 0 and f8.kept_weight_numel > 0
    rows = {r.what: r.bytes for r in job.memory_plan.rows}
    # the kept cast with its block scales, and the dgrad's column-major byte copy of it
    assert rows["FP8 weights kept through the step"] == 2 * f8.kept_weight_numel + f8.kept_weight_numel // 4096
    assert validate_job(load_job_config(BLOCKWISE), world_size=1).build.float8.weights_per_step == 0  # auto: off
    monkeypatch.setattr("trainer.validate.resolve._linears_by_default", lambda pd: True)  # auto's rule where on
    assert validate_job(load_job_config(BLOCKWISE), world_size=1).build.float8.weights_per_step == 4
    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config([*ARGS, "--float8.recipe=rowwise", "--float8.weights_per_step=on"]),
                     world_size=1)
    assert "float8.weights_per_step='on' cannot run with float8.recipe='rowwise'" in str(e.value)
    assert "\n" not in str(e.value)


def test_whole_run_with_grad_accumulation_is_bit_equal_to_casting_per_use(tmp_path: Path, caplog,
                                                                         monkeypatch) -> None:
    """The debug model under blockwise (emulated), 3 steps of 4 microbatches: every step's loss and gradient norm
    bit-equal with and without the kept casts, the startup line says it, and the weight casts per step fall from
    4 x (forward, input-gradient GEMM) to 1 per converted Linear."""
    casts = count_weight_casts(monkeypatch)
    with caplog.at_level(logging.INFO, logger="trainer"):
        kept, kept_casts = losses_and_casts(BLOCKWISE, tmp_path / "kept", "on", casts)
    assert any("recipe=BLOCKWISE" in r.getMessage()
               and "FP8 weights cast once per step (4 microbatches reuse them" in r.getMessage() for r in caplog.records)
    per_use, per_use_casts = losses_and_casts(BLOCKWISE, tmp_path / "per_use", "off", casts)
    assert kept == per_use and len(kept) == 3
    linears = 21  # the debug model's Linears with both dims multiples of 128 (of 29)
    assert (kept_casts, per_use_casts) == (3 * linears, 3 * linears * 4 * 2)
