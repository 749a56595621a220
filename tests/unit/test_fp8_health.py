"""FP8 health: underflow and saturation of the activation and gradient casts, per layer group (in a whole run:
tests/cli/test_fp8_health.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from trainer.loss import LossFn
from trainer.models import FLAVORS, Llama
from trainer.parallel.float8 import Float8Options, apply_float8
from trainer.parallel.float8.health import Fp8HealthMonitor, cast_health, layer_group


def _fp8_debug_model() -> Llama:
    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    apply_float8(model, Float8Options(recipe="tensorwise"), device=torch.device("cpu"))
    return model


def test_cast_health_counts_what_rounds_to_zero():
    # One outlier at 1e4 sets the e4m3 scale to 448/1e4; values of 1e-3 then scale to 4.5e-5, below half
    # of e4m3's smallest subnormal (2^-9): they become 0.
    x = torch.full((4, 256), 1e-3)
    x[0, 0] = 1e4
    h = cast_health(x, "e4m3", rowwise=False)
    assert h["amax"].item() == pytest.approx(1e4) and h["scale"].item() == pytest.approx(448 / 1e4)
    assert h["underflow"].item() == x.numel() - 1 and h["saturated"].item() == 0
    # Per-row scales rescue every row but the outlier's.
    rows = cast_health(x, "e4m3", rowwise=True)
    assert rows["underflow"].item() == 255
    # Values of one order of magnitude spread are all representable.
    normal = cast_health(torch.linspace(0.1, 1.0, 1024).reshape(4, 256), "e5m2", rowwise=False)
    assert normal["underflow"].item() == 0 and normal["saturated"].item() == 0


def test_monitor_reports_the_layer_fed_tiny_values_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("trainer"), "propagate", True)
    model = _fp8_debug_model()
    monitor = Fp8HealthMonitor(model, recipe="tensorwise")
    assert layer_group("layers.2.mlp.down_proj") == "mlp.down_proj" and "output_head.proj" in monitor.modules
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))

    # Healthy: the debug model's own activations and gradients.
    with monitor.collect():
        LossFn(model.norm, model.output_head)(model(tokens), tokens).backward()
    healthy = monitor.report()
    assert healthy["fp8_health/input/mlp.down_proj/underflow"] < 0.01
    assert {k.split("/")[1] for k in healthy} == {"input", "grad"}
    assert all(k.split("/")[2] in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "output_head.proj")
               for k in healthy)

    # Sick: one layer's input is a single outlier over values 1e7 times smaller.
    def outlier(module, args):
        x = torch.full_like(args[0], 1e-4)
        x[..., 0, 0] = 1e3
        return (x,)

    handle = model.layers["1"].mlp.up_proj.register_forward_pre_hook(outlier)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer"), monitor.collect():
        LossFn(model.norm, model.output_head)(model(tokens), tokens).backward()
        stats = monitor.report()
    handle.remove()
    # mlp.up_proj of 4 layers, one of them all-underflowing: about a quarter of the group.
    assert stats["fp8_health/input/mlp.up_proj/underflow"] == pytest.approx(0.25, abs=0.01)
    assert stats["fp8_health/input/mlp.gate_proj/underflow"] < 0.01
    warnings = [r.getMessage() for r in caplog.records if "fp8 health" in r.getMessage()]
    assert len(warnings) == 1 and "of layers.1.mlp.up_proj's input elements underflow to zero in e4m3" in warnings[0]
