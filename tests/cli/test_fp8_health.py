"""FP8 health in a whole run: the stats steps are logged and change no loss. The casts and the monitor in-process:
tests/unit/test_fp8_health.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, column, launch, launch_ok, read_metrics, train


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


@pytest.mark.slow
def test_the_block_input_kurtosis_warns_above_metrics_kurtosis_warn_only(tmp_path: Path):
    """At the stats steps only, each block's input kurtosis goes to metrics.jsonl; a threshold below it warns (one line
    naming the worst block and the key), one far above it does not; a negative one is refused in one line."""
    args = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=32", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp8", "--metrics.fp8_stats_freq=2"]
    runs = {}
    for name, threshold in (("tiny", 1.0), ("huge", 1e9)):
        proc = launch_ok([*args, f"--metrics.kurtosis_warn={threshold}"], tmp_path / name)
        runs[name] = (proc.stdout + proc.stderr, read_metrics(tmp_path / name))
    said, records = runs["tiny"]
    kurtosis = [{k: v for k, v in r.items() if k.startswith("fp8_health/block_input/")} for r in records]
    assert [sorted(k) for k in kurtosis] == [[], [f"fp8_health/block_input/{x}" for x in (
        "kurtosis_max", "layers.0/kurtosis", "layers.1/kurtosis", "layers.2/kurtosis", "layers.3/kurtosis")], [],
        sorted(kurtosis[1])]
    for k in kurtosis[1::2]:  # at least 1 (every channel alike), at most the width; the max is the blocks' max
        assert all(1 <= v <= 128 for v in k.values())
        assert k["fp8_health/block_input/kurtosis_max"] == max(v for n, v in k.items() if n.endswith("/kurtosis"))
    warned = [line for line in said.splitlines() if "outlier features:" in line]
    assert len(warned) == 2 and all("above metrics.kurtosis_warn=1 (4 of 4 blocks are)" in w for w in warned)
    worst = max((v, n) for n, v in kurtosis[1].items() if n.endswith("/kurtosis"))[1].split("/")[2]
    assert f"outlier features: {worst}'s input has a channel kurtosis of" in warned[0]
    quiet, quiet_records = runs["huge"]
    assert "outlier features" not in quiet
    key = "fp8_health/block_input/kurtosis_max"
    assert column(quiet_records[1::2], key) == column(records[1::2], key)  # the same run: the threshold only warns
    refused = launch([*args, "--metrics.kurtosis_warn=-3", f"--job.dump_folder={tmp_path / 'bad'}"])
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "metrics.kurtosis_warn=-3.0 must be >= 0 (0 = off)")
