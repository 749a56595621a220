"""scripts/fp8_parity.py run as a command: the verdict passes real FP8 and fails FP8 that was made wrong on purpose,
legs split over calls are reused, and a bad override is a config error. Its functions in-process:
tests/unit/test_fp8_parity.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO, env, read_metrics


SCRIPT = REPO / "scripts" / "fp8_parity.py"
SHORT = ["--train.steps=30", "--train.seq_len=64", "--tolerance=0.05"]
# The split/reuse mechanics need legs that finish, not legs that learn: 5 steps each.
MECHANICS = ["--train.steps=5", "--train.seq_len=64", "--tolerance=0.05"]


def _parity(out: Path, *args: str, break_fp8: bool = False) -> subprocess.CompletedProcess:
    e = env()
    if break_fp8:
        e["PYTHONPATH"] = str(REPO / "tests" / "support" / "broken_fp8") + ":" + e["PYTHONPATH"]
        e["TRAINER_TEST_BREAK_FP8"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), "--config", DEBUG_CONFIG, f"--out={out}", *args],
                          capture_output=True, text=True, env=e, cwd=REPO, timeout=900)


def test_bad_override_is_a_config_error(tmp_path: Path):
    proc = _parity(tmp_path, "--train.stepz=3")
    assert proc.returncode == 2 and "config error: unknown key [train].stepz" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # no leg started


@pytest.mark.slow
def test_legs_split_over_two_calls_and_two_variants(tmp_path: Path):
    variants = ["--variant", "tw=", "--variant", "head=--float8.exclude_fqns=output_head.proj"]
    first = _parity(tmp_path, *MECHANICS, *variants, "--legs", "bf16,tw")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "legs not run yet: bf16-seed2, head" in first.stdout and not (tmp_path / "parity.json").exists()
    bf16_metrics = (tmp_path / "bf16" / "metrics.jsonl").read_text()
    second = _parity(tmp_path, *MECHANICS, *variants)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "[bf16] reused" in second.stdout and "[tw] reused" in second.stdout and "[head] reused" not in second.stdout
    assert (tmp_path / "bf16" / "metrics.jsonl").read_text() == bf16_metrics  # not rerun
    summary = json.loads((tmp_path / "parity.json").read_text())
    assert set(summary["variants"]) == {"tw", "head"} and summary["passed"]
    assert "PASS: final validation loss tw" in second.stdout and "PASS: final validation loss head" in second.stdout
    assert "excluded: output_head.proj" in (tmp_path / "head.log").read_text()
    # A third call with a changed override reruns every leg's command, so nothing is reused.
    third = _parity(tmp_path, *MECHANICS, "--train.steps=6", *variants, "--legs", "bf16")
    assert third.returncode == 0 and "[bf16] reused" not in third.stdout and "[bf16] /" in third.stdout


@pytest.fixture(scope="module")
def bf16_legs(tmp_path_factory) -> Path:
    """The two bf16 legs of a SHORT run, run once: a test copies them into its --out, where the script reuses
    them (a finished leg's command names no --out folder) and runs the fp8 leg itself."""
    out = tmp_path_factory.mktemp("bf16_legs")
    proc = _parity(out, *SHORT, "--legs", "bf16,bf16-seed2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _with_bf16_legs(bf16_legs: Path, tmp_path: Path) -> Path:
    """A fresh --out holding the finished bf16 legs."""
    out = tmp_path / "out"
    shutil.copytree(bf16_legs, out)
    return out


@pytest.mark.slow
def test_real_fp8_passes_and_writes_table_json_and_plot(bf16_legs: Path, tmp_path: Path):
    out = _with_bf16_legs(bf16_legs, tmp_path)
    proc = _parity(out, *SHORT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "parity.json").read_text())
    assert summary["passed"] and "PASS: final validation loss fp8" in proc.stdout
    for leg in ("bf16", "bf16-seed2", "fp8"):  # the verdict reads each leg's own final validation loss
        assert summary["final_val_loss"][leg] == read_metrics(out / leg)[-1]["val_loss"]
    assert "Applied Float8 training" in (out / "fp8.log").read_text()
    assert "Applied Float8 training" not in (out / "bf16.log").read_text()
    png = (out / "parity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1000


@pytest.mark.slow
def test_broken_fp8_fails(bf16_legs: Path, tmp_path: Path):
    out = _with_bf16_legs(bf16_legs, tmp_path)
    proc = _parity(out, *SHORT, break_fp8=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "parity.json").read_text())
    assert not summary["passed"] and summary["fp8_gap"] > 0.2
    assert "FAIL: final validation loss fp8" in proc.stdout
