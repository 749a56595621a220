"""FP8 health in a whole run: the stats steps are logged and change no loss. The casts and the monitor in-process:
tests/unit/test_fp8_health.py."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import DEBUG_CONFIG, column, train


def test_stats_steps_are_logged_and_change_no_loss(tmp_path: Path):
    args = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=32", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp8"]
    with_stats = train([*args, "--metrics.fp8_stats_freq=2"], tmp_path / "stats")
    without = train([*args, "--metrics.fp8_stats_freq=0"], tmp_path / "plain")
    assert column(with_stats, "loss") == column(without, "loss")
    has_health = [any(k.startswith("fp8_health/") for k in r) for r in with_stats]
    assert has_health == [False, True, False, True]
    assert "fp8/weight_amax/output_head.proj" in with_stats[1]
    assert not any(k.startswith("fp8") and k != "fp8_converted_fraction" for r in without for k in r)
