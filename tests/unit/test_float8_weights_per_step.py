"""float8.weights_per_step (trainer.parallel.float8.weights_per_step): each FP8 weight cast once per optimizer step,
reused by every microbatch's forward, backward and activation-checkpoint recompute, bit for bit what casting per use
computes; the next step casts the new weights; the config's resolution, startup line and memory plan; a whole CLI
run with grad_accum_steps=4 equal to the uncached run. Several ranks: tests/distributed/test_float8_weights_per_step.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import DEBUG_CONFIG, read_metrics
from tests.unit.test_float8_scaling import aten_scaled_mm, converted  # noqa: F401  (autouse: aten's CPU _scaled_mm)
from tests.unit.test_float8_scaling_compile import Block
from trainer.config import load_job_config
from trainer.errors import ConfigError


def count_weight_casts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every tensorwise cast of a weight (the module's one cast function), as the id of the weight's shape."""
    import trainer.parallel.float8.tensorwise as tensorwise

    casts, cast = [], tensorwise._to_float8

    def counting(t, role, *args, **kwargs):
        if role == tensorwise.GemmInputRole.WEIGHT:
            casts.append(tuple(t.shape))
        return cast(t, role, *args, **kwargs)

    monkeypatch.setattr(tensorwise, "_to_float8", counting)
    return casts


def two_models(*, delayed: bool) -> tuple[nn.Module, nn.Module, list]:
    """The same bf16 model of two blocks behind full AC, converted to our tensorwise Linear (emulated), twice; with
    delayed scaling each gets its DelayedScaling hook."""
    from trainer.parallel.float8.delayed import DelayedScaling

    torch.manual_seed(0)
    base = converted(nn.Sequential(Block(), Block()).to(torch.bfloat16), emulate=True, delayed=delayed)
    models = (base, copy.deepcopy(base))
    hooks = [[DelayedScaling(m, history_len=4, algo="max", margin=0, group=None)] if delayed else [] for m in models]
    return *models, hooks


@pytest.mark.parametrize("delayed", [False, True])
def test_grad_accumulation_is_bit_equal_with_one_cast_per_weight_per_step(monkeypatch, delayed: bool) -> None:
    """4 microbatches per step, 3 steps of SGD: every output and every gradient bit-equal to casting per use; per
    step each weight is cast once (the hook) where per use costs 4 x (forward, recompute, backward) = 12; each step's
    kept cast is of that step's weights (it changes with them, and a stale one would break step 2's equality)."""
    from trainer.parallel.float8.weights_per_step import Fp8WeightsPerStep, kept_linears

    per_use, per_step, hooks = two_models(delayed=delayed)
    keep = Fp8WeightsPerStep(per_step, dtype=torch.bfloat16)
    assert len(keep.linears) == 4 and keep.nbytes == 4 * 64 * 128
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (per_use, per_step)]
    casts = count_weight_casts(monkeypatch)
    kept_before = None
    for step in (1, 2, 3):
        counts = []
        for model, step_hooks, uses_cache in ((per_use, hooks[0], False), (per_step, hooks[1], True)):
            casts.clear()
            with keep.step_context(step) if uses_cache else torch.enable_grad():
                kept = [m.fp8_weight for m in kept_linears(model).values()] if uses_cache else None
                outs = []
                for micro in range(4):
                    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(micro))
                    out = model(x * step)
                    (out.float() ** 2).mean().backward()
                    outs.append(out)
                if uses_cache:
                    keep.after_forward_backward(step)
                    assert all(m.fp8_weight is None for m in keep.linears)  # gone before the optimizer step
            counts.append(len(casts))
            model.outs = outs
            if uses_cache:
                kept_data = [k[0].view(torch.uint8) for k in kept]
                if kept_before is not None:  # the new weights' cast, not the last step's
                    assert not all(torch.equal(a, b) for a, b in zip(kept_data, kept_before))
                kept_before = kept_data
        assert counts == [4 * 12, 4]  # four weights: 12 casts each per use, one each per step
        for a, b in zip(per_use.outs, per_step.outs):
            assert torch.equal(a, b)
        for a, b in zip(per_use.parameters(), per_step.parameters()):
            assert torch.equal(a.grad, b.grad)
        for opt, step_hooks in zip(optimizers, hooks):
            opt.step()
            opt.zero_grad()
            for hook in step_hooks:
                hook.after_optimizer_step(step, torch.tensor(False))
    if delayed:  # the kept weight's amax is recorded by every forward as before: the same histories
        assert torch.equal(hooks[0][0].history, hooks[1][0].history)


def test_nothing_is_kept_outside_a_step_and_an_exception_drops_the_casts() -> None:
    """Between steps (an evaluation, the EMA swapped in) the Linears cast what they multiply; a step that raises
    still drops its casts."""
    from trainer.parallel.float8.weights_per_step import Fp8WeightsPerStep

    _, model, _ = two_models(delayed=False)
    keep = Fp8WeightsPerStep(model, dtype=torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
        with keep.step_context(1):
            for p in model.parameters():
                p.mul_(2.0)  # weights changed inside a step: only the optimizer does that, after forward/backward
            assert torch.equal(model(x), before)  # the step's casts serve its forwards: the cache is real
        assert not torch.equal(model(x), before)  # after the step: the new weights
    with pytest.raises(RuntimeError, match="boom"), keep.step_context(2):
        raise RuntimeError("boom")
    assert all(m.fp8_weight is None for m in keep.linears)


ARGS = ["--config", DEBUG_CONFIG, "--train.seq_len=64", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
        "--train.mixed_precision=fp8", "--float8.emulate=true", "--train.steps=3", "--train.grad_accum_steps=4",
        "--train.batch_size=1"]


@pytest.mark.parametrize("args, world_size, kept", [
    ([], 1, 4),  # four microbatches share each cast
    (["--train.grad_accum_steps=1"], 1, 0),  # one use per step: nothing to share (auto)
    (["--train.grad_accum_steps=1", "--train.activation_checkpointing=full"], 1, 1),  # the recompute reuses it
    (["--train.grad_accum_steps=1", "--float8.weights_per_step=on"], 1, 1),  # backward reuses the forward's
    (["--float8.weights_per_step=off"], 1, 0),
    (["--distributed.dp_shard=2"], 2, 0),  # FSDP-sharded: gathered per microbatch (auto: off)
    (["--distributed.dp_replicate=2"], 2, 4),  # replicas hold whole weights
    (["--float8.recipe=rowwise"], 1, 0),
])
def test_auto_keeps_casts_where_a_weight_is_used_again_and_unsharded(args: list[str], world_size: int,
                                                                     kept: int, monkeypatch) -> None:
    """auto's rule for the Linears where it is on (pipeline parallelism, below; elsewhere off until measured there:
    trainer.validate.resolve._linears_by_default)."""
    from trainer.validate import validate_job

    monkeypatch.setattr("trainer.validate.resolve._linears_by_default", lambda pd: True)

    job = validate_job(load_job_config([*ARGS, *args]), world_size=world_size)
    assert job.build.float8.weights_per_step == kept
    rows = {r.what: r.bytes for r in job.memory_plan.rows}
    # the kept cast and its column-major copy for the input-gradient GEMM: 2 B per converted element
    assert rows.get("FP8 weights kept through the step", 0) == (2 * job.build.float8.kept_weight_numel if kept else 0)
    assert job.build.float8.kept_weight_numel > 0


def test_auto_keeps_the_linears_casts_under_pipeline_parallelism_only() -> None:
    """Measured faster there (pp=2 1F1B, 8 microbatches: 1.025x); with accumulation on one GPU it measured slower."""
    from trainer.validate import validate_job

    job = validate_job(load_job_config(ARGS), world_size=1)  # 4 microbatches: auto's rule would keep them
    assert job.build.float8.weights_per_step == 0
    pp = ["--distributed.pp=2", "--train.grad_accum_steps=1", "--train.batch_size=4"]
    assert validate_job(load_job_config([*ARGS, *pp]), world_size=2).build.float8.weights_per_step == 4
    assert validate_job(load_job_config([*ARGS, *pp, "--float8.weights_per_step=off"]), world_size=2
                        ).build.float8.weights_per_step == 0
    assert validate_job(load_job_config([*ARGS, "--float8.weights_per_step=on"]), world_size=1
                        ).build.float8.weights_per_step == 4


@pytest.mark.parametrize("args, message", [
    (["--distributed.dp_shard=2"], "float8.weights_per_step='on' cannot run with distributed.dp_shard x cp = 2"),
    (["--float8.recipe=rowwise"], "float8.weights_per_step='on' cannot run with float8.recipe='rowwise'"),
    (["--float8.forward=bf16"], "float8.weights_per_step='on' cannot run with float8.forward='bf16'"),
])
def test_on_where_it_cannot_run_names_the_key_in_one_line(args: list[str], message: str) -> None:
    from trainer.validate import validate_job

    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config([*ARGS, "--float8.weights_per_step=on", *args]), world_size=2)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_startup_line_says_how_many_microbatches_reuse_the_cast() -> None:
    from trainer.parallel.float8 import Float8Options, float8_converters

    line = float8_converters(Float8Options(recipe="tensorwise", weights_per_step=4))[0].lines()[0]
    assert line.endswith(", FP8 weights cast once per step (4 microbatches reuse them, backward and recompute too)")


def losses_and_casts(args: list[str], dump: Path, setting: str, casts: list) -> tuple[list[tuple[float, float]], int]:
    """One training run of `args` with float8.weights_per_step=setting: every logged step's (loss, grad norm) and
    how many weight casts it made (`casts`: a count_weight_casts list, emptied first)."""
    from trainer.run.train import train

    casts.clear()
    train(load_job_config([*args, f"--job.dump_folder={dump}", f"--float8.weights_per_step={setting}"]))
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(dump)], len(casts)


def test_whole_run_with_grad_accumulation_is_bit_equal_to_casting_per_use(tmp_path: Path, caplog,
                                                                         monkeypatch) -> None:
    """The debug model, 3 steps of 4 microbatches: every step's loss and gradient norm bit-equal with and without
    the kept casts (steps 2 and 3 on weights the optimizer moved), the startup line says it, and the weight casts
    per step fall from 4 x (forward, backward) to 1 per converted Linear."""
    import logging

    casts = count_weight_casts(monkeypatch)
    with caplog.at_level(logging.INFO, logger="trainer"):
        kept, kept_casts = losses_and_casts(ARGS, tmp_path / "kept", "on", casts)
    assert any("FP8 weights cast once per step (4 microbatches reuse them" in r.getMessage() for r in caplog.records)
    # off: torchao's Float8Linear, the default tensorwise path
    torchaos, _ = losses_and_casts(ARGS, tmp_path / "torchao", "off", casts)
    monkeypatch.setattr("trainer.parallel.float8.linear.OWN_TENSORWISE_LINEAR", True)  # ours, casting per use
    per_use, per_use_casts = losses_and_casts(ARGS, tmp_path / "per_use", "off", casts)
    assert kept == per_use == torchaos and len(kept) == 3
    linears = 29  # the debug model's converted Linears (4 blocks x 7, and the head)
    assert (kept_casts, per_use_casts) == (3 * linears, 3 * linears * 4 * 2)


@pytest.mark.slow  # inductor codegen of a toy model, twice (~40 s on a loaded 2-core CPU)
def test_compiled_reads_the_kept_casts_as_inputs_bit_equal_and_compiles_once() -> None:
    """torch.compile(fullgraph=True) over blocks under full AC: the kept casts (made eagerly, outside the graph) are
    graph inputs; 3 steps of 2 microbatches give the uncached compiled run's outputs and gradients bit for bit, and
    the cached model compiles one graph for all steps (no recompile when the next step's casts arrive)."""
    per_use, per_step, _ = two_models(delayed=False)
    assert_compiled_bit_equal_and_compiles_once(per_use, per_step, input_shape=(2, 8, 64))


def test_a_resume_casts_the_loaded_weights(tmp_path: Path) -> None:
    """4 steps of 4 microbatches with the kept casts == 2 steps, then a resume to 4: the first step after the load
    casts the checkpoint's weights (a cast kept from before the load would break step 3's equality)."""
    from trainer.run.train import train

    def run(dump: Path, steps: int) -> list[float]:
        train(load_job_config([*ARGS, f"--job.dump_folder={dump}", f"--train.steps={steps}",
                               "--checkpoint.enable=true", "--checkpoint.interval=2",
                               "--scheduler.decay_type=constant",  # the LR at a step does not depend on steps
                               "--float8.weights_per_step=on"]))
        return [r["loss"] for r in read_metrics(dump)]

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "resumed", 2)
    assert run(tmp_path / "resumed", 4) == whole and len(whole) == 4


def assert_compiled_bit_equal_and_compiles_once(per_use: nn.Module, per_step: nn.Module, *,
                                                input_shape: tuple[int, ...]) -> None:
    """3 steps of 2 microbatches through torch.compile(fullgraph=True): per_step (its casts kept by
    Fp8WeightsPerStep) gives per_use's outputs and gradients bit for bit, and compiles one graph for all steps.
    Also the blockwise test's (tests/unit/test_float8_weights_per_step_blockwise.py)."""
    from torch._dynamo.utils import counters

    from trainer.parallel.float8.weights_per_step import Fp8WeightsPerStep

    keep = Fp8WeightsPerStep(per_step, dtype=torch.bfloat16)
    runs = [torch.compile(m, fullgraph=True) for m in (per_use, per_step)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (per_use, per_step)]
    torch._dynamo.reset()
    graphs = []
    for step in (1, 2, 3):
        outs = []
        for run, uses_cache in zip(runs, (False, True)):
            counters.clear()
            with keep.step_context(step) if uses_cache else torch.enable_grad():
                for micro in range(2):
                    x = torch.randn(*input_shape, dtype=torch.bfloat16,
                                    generator=torch.Generator().manual_seed(micro))
                    out = run(x * step)
                    (out.float() ** 2).mean().backward()
                    outs.append(out)
            if uses_cache:
                graphs.append(counters["stats"]["unique_graphs"])
        for a, b in zip(outs[:2], outs[2:]):
            assert torch.equal(a, b)
        for a, b in zip(per_use.parameters(), per_step.parameters()):
            assert torch.equal(a.grad, b.grad)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert graphs == [1, 0, 0]
