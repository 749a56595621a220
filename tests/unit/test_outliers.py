"""The blocks' input kurtosis of the FP8 health stats (trainer/parallel/float8/outliers.py): FOG's definition against a
numpy float64 reference and its closed forms, and the monitor on a model's blocks (in a whole run:
tests/cli/test_fp8_health.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from trainer.models import FLAVORS, Llama
from trainer.parallel.float8 import Float8Options, apply_float8
from trainer.parallel.float8.health import Fp8HealthHook
from trainer.parallel.float8.outliers import BlockInputKurtosis, channel_kurtosis, kurtosis_of


def _reference(x: np.ndarray) -> float:
    """FOG's Kurt(X) for X (tokens x channels), in float64: the kurtosis of the channels' RMS over the tokens."""
    s = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=0))
    return float(np.mean(s**4) / np.mean(s**2) ** 2)


def test_kurtosis_matches_numpy_float64_on_heavy_tailed_activations() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 96, generator=g) * torch.rand(96, generator=g) ** 3  # channels of very different scale
    x[:, :, 7] += 40.0  # and one channel large for every token
    reference = _reference(x.reshape(-1, 96).numpy())
    assert reference > 20
    assert kurtosis_of(x).item() == pytest.approx(reference, rel=1e-12)
    # From float32 squares summed in float64 (what the hook records): float32 rounding of the squares only.
    sums = x.reshape(-1, 96).float().square().sum(0, dtype=torch.float64)
    assert channel_kurtosis(sums).item() == pytest.approx(reference, rel=1e-6)


@pytest.mark.parametrize("d, r", [(64, 10.0), (4096, 100.0), (8, 1.0)])
def test_one_outlier_channel_gives_the_closed_form(d: int, r: float) -> None:
    """d - 1 channels of RMS 1 and one of RMS r: d (d - 1 + r^4) / (d - 1 + r^2)^2 (1 when r = 1)."""
    x = torch.ones(16, d, dtype=torch.float64)
    x[::2] = -1.0  # the sign is not the scale
    x[:, 0] *= r
    expected = d * (d - 1 + r**4) / (d - 1 + r**2) ** 2
    assert kurtosis_of(x).item() == pytest.approx(expected, rel=1e-12)
    assert kurtosis_of(x).item() == pytest.approx(_reference(x.numpy()), rel=1e-12)


def test_the_bounds_and_what_the_kurtosis_does_not_see() -> None:
    d = 32
    only = torch.zeros(10, d, dtype=torch.float64)
    only[:, 3] = 2.5
    assert kurtosis_of(only).item() == pytest.approx(d, rel=1e-12)  # one channel holds everything: d
    assert kurtosis_of(torch.zeros(10, d)).item() == 0  # nothing stands out (no NaN)
    x = torch.randn(20, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    base = kurtosis_of(x).item()
    assert kurtosis_of(1e3 * x).item() == pytest.approx(base, rel=1e-12)  # the scale
    assert kurtosis_of(torch.cat([x, x])).item() == pytest.approx(base, rel=1e-12)  # tokens counted twice (AC)
    spike = x.clone()
    spike[0, 5] = 1e3  # a massive activation on one token: its channel's RMS grows, so this one does see it
    assert kurtosis_of(spike).item() > 10 * base


def _block_inputs(model: Llama, tokens: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [block.register_forward_pre_hook(lambda m, args, i=i: seen.setdefault(f"layers.{i}", []).append(
        args[0].detach().clone())) for i, block in model.layers.items()]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return seen


def test_the_monitor_records_each_blocks_input_over_every_microbatch_and_warns_above_the_threshold(caplog) -> None:
    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(2)
    microbatches = [torch.randint(0, 512, (2, 24), generator=g) for _ in range(2)]
    inputs: dict[str, list[torch.Tensor]] = {}
    for tokens in microbatches:
        for fqn, xs in _block_inputs(model, tokens).items():
            inputs.setdefault(fqn, []).extend(xs)
    expected = {fqn: _reference(torch.cat(xs).reshape(-1, 128).numpy()) for fqn, xs in inputs.items()}
    assert len(expected) == 4
    monitor = BlockInputKurtosis(model, warn_above=min(expected.values()) * 1.0001)
    assert sorted(monitor.blocks) == sorted(expected)
    with monitor.collect(), torch.no_grad():
        for tokens in microbatches:
            model(tokens)
    with caplog.at_level(logging.WARNING):
        stats = monitor.report()
    for fqn, value in expected.items():
        assert stats[f"fp8_health/block_input/{fqn}/kurtosis"] == pytest.approx(value, rel=1e-6)
    worst = max(expected, key=expected.get)
    assert stats["fp8_health/block_input/kurtosis_max"] == pytest.approx(expected[worst], rel=1e-6)
    warnings = [r.getMessage() for r in caplog.records if "outlier features" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"outlier features: {worst}'s input has a channel kurtosis")
    assert "(3 of 4 blocks are)" in warnings[0]  # every block but the one at the threshold's base
    # Hooks are gone after collect(), and a report clears what was collected.
    with torch.no_grad():
        model(microbatches[0])
    assert monitor.report() == {}
    # A huge threshold (or 0: off) records the same and warns about nothing.
    for threshold in (1e9, 0.0):
        quiet = BlockInputKurtosis(model, warn_above=threshold)
        caplog.clear()
        with quiet.collect(), torch.no_grad(), caplog.at_level(logging.WARNING):
            model(microbatches[0])
            assert quiet.report()["fp8_health/block_input/kurtosis_max"] > 1
        assert not [r for r in caplog.records if "outlier features" in r.getMessage()]


def test_the_fp8_health_hook_logs_the_kurtosis_at_its_steps_only() -> None:
    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    apply_float8(model, Float8Options(recipe="tensorwise"), device=torch.device("cpu"))
    hook = Fp8HealthHook(model, recipe="tensorwise", every=2, kurtosis_warn=0.0)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    for step in (1, 2):
        with hook.step_context(step), torch.no_grad():
            model(tokens)
        logged = hook.on_log(step)
        kurtosis = {k for k in logged if k.startswith("fp8_health/block_input/")}
        assert kurtosis == (set() if step == 1 else {f"fp8_health/block_input/layers.{i}/kurtosis" for i in range(4)}
                            | {"fp8_health/block_input/kurtosis_max"})
