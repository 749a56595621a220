"""FP8 weight statistics (the health metrics: tests/unit/test_metrics.py; profiling through the trainer:
tests/cli/test_observability.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import fp8_linear_counts


def test_fp8_weight_stats_per_layer() -> None:
    from trainer.models import FLAVORS, Llama
    from trainer.parallel.float8 import Float8Options, apply_float8, float8_weight_stats

    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    apply_float8(model, Float8Options(recipe="tensorwise", emulate=True), device=torch.device("cpu"))
    stats = float8_weight_stats(model)
    amax = stats["fp8/weight_amax/layers.0.attention.q_proj"]
    assert amax == pytest.approx(model.layers["0"].attention.q_proj.weight.abs().max().item())
    assert stats["fp8/weight_scale/layers.0.attention.q_proj"] == pytest.approx(448.0 / amax)
    assert len(stats) == 2 * fp8_linear_counts(FLAVORS["debug"])[0]  # amax and scale per converted Linear
