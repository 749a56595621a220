"""scripts/fp8_parity.py: the verdict passes real FP8 and fails FP8 that was made wrong on purpose."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO, env, read_metrics

SCRIPT = REPO / "scripts" / "fp8_parity.py"
SHORT = ["--train.steps=30", "--train.seq_len=64", "--tolerance=0.05"]
sys.path.insert(0, str(REPO / "scripts"))
import fp8_parity  # noqa: E402


def _parity(out: Path, *args: str, break_fp8: bool = False) -> subprocess.CompletedProcess:
    e = env()
    if break_fp8:
        e["PYTHONPATH"] = str(REPO / "tests" / "support" / "broken_fp8") + ":" + e["PYTHONPATH"]
        e["TRAINER_TEST_BREAK_FP8"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), "--config", DEBUG_CONFIG, f"--out={out}", *args],
                          capture_output=True, text=True, env=e, cwd=REPO, timeout=900)


def test_verdict_uses_the_larger_of_noise_floor_and_tolerance():
    loose = fp8_parity.verdict({"bf16": 2.0, "bf16-seed2": 2.06, "fp8": 2.05}, tolerance=0.01)
    assert loose["noise_floor"] == pytest.approx(0.03) and loose["allowed"] == pytest.approx(0.03) and loose["passed"]
    tight = fp8_parity.verdict({"bf16": 2.0, "bf16-seed2": 2.001, "fp8": 2.05}, tolerance=0.01)
    assert tight["allowed"] == 0.01 and tight["fp8_gap"] == pytest.approx(0.025) and not tight["passed"]


def test_windows_average_the_logged_steps():
    curve = {1: 6.0, 5: 4.0, 10: 3.0, 15: 2.0, 20: 1.0}
    assert fp8_parity.window_means(curve, 20, 2) == [(1, 10, pytest.approx(13 / 3)), (11, 20, 1.5)]


def test_bad_override_is_a_config_error(tmp_path: Path):
    proc = _parity(tmp_path, "--train.stepz=3")
    assert proc.returncode == 2 and "config error: unknown key [train].stepz" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # no leg started


@pytest.mark.slow
def test_real_fp8_passes_and_writes_table_json_and_plot(tmp_path: Path):
    proc = _parity(tmp_path, *SHORT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "parity.json").read_text())
    assert summary["passed"] and "PASS: final validation loss fp8" in proc.stdout
    for leg in fp8_parity.LEGS:  # the verdict reads each leg's own final validation loss
        assert summary["final_val_loss"][leg] == read_metrics(tmp_path / leg)[-1]["val_loss"]
    assert "Applied Float8 training" in (tmp_path / "fp8.log").read_text()
    assert "Applied Float8 training" not in (tmp_path / "bf16.log").read_text()
    png = (tmp_path / "parity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 800


@pytest.mark.slow
def test_broken_fp8_fails(tmp_path: Path):
    proc = _parity(tmp_path, *SHORT, break_fp8=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "parity.json").read_text())
    assert not summary["passed"] and summary["fp8_gap"] > 0.2
    assert "FAIL: final validation loss fp8" in proc.stdout
