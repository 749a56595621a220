"""scripts/fp8_parity.py run as a command: the README's default command passes real FP8 and fails FP8 made wrong on
purpose, legs split over calls are reused, and a bad override is a config error. Its functions in-process:
tests/unit/test_fp8_parity.py (the seeds each leg trains at, any offset). That the verdict does not hang on the
seeds drawn is measured, not run here: PASS at all 9 offsets of 8 of 16 seeds (docs/fp8.md#check-that-fp8-did-not-hurt;
a second 8-seed run took 17 minutes of CI on a slow machine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO, env, read_metrics


SCRIPT = REPO / "scripts" / "fp8_parity.py"
# The split/reuse mechanics need legs that finish, not legs that learn: 5 steps each, one seed.
MECHANICS = ["--seeds", "1", "--train.steps=5", "--train.seq_len=64", "--tolerance=0.05"]


def _parity(out: Path, *args: str, break_fp8: bool = False) -> subprocess.CompletedProcess:
    e = env()
    if break_fp8:
        e["PYTHONPATH"] = str(REPO / "tests" / "support" / "broken_fp8") + ":" + e["PYTHONPATH"]
        e["TRAINER_TEST_BREAK_FP8"] = "1"
    # 1800 s: the README's 8-seed command took ~15 min on a 2-core machine running at half its usual speed (900 s
    # timed out there on 2026-11-28); a hang still ends well inside .ci/run's 90 minutes.
    return subprocess.run([sys.executable, str(SCRIPT), "--config", DEBUG_CONFIG, f"--out={out}", *args],
                          capture_output=True, text=True, env=e, cwd=REPO, timeout=1800)


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
def default_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's command as it stands (the debug config, --seeds auto: 8 seeds of bf16 and of fp8), run once."""
    out = tmp_path_factory.mktemp("parity_default")
    return out, _parity(out)


@pytest.mark.slow
def test_the_default_command_passes_and_writes_table_json_and_plot(default_run):
    out, proc = default_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "parity.json").read_text())
    assert summary["seeds"] == 8 and summary["verdict"] == "PASS" and "PASS: final validation loss fp8" in proc.stdout
    for leg in ("bf16", "bf16-seed8", "fp8", "fp8-seed8"):  # the verdict reads each leg's own final validation loss
        assert summary["final_val_loss"][leg] == read_metrics(out / leg)[-1]["val_loss"]
    assert "Applied Float8 training" in (out / "fp8.log").read_text()
    assert "Applied Float8 training" not in (out / "bf16.log").read_text()
    png = (out / "parity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1000


@pytest.mark.slow
def test_broken_fp8_fails(default_run, tmp_path: Path):
    """FP8 scales 16x too large (tests/support/broken_fp8): a measured regression, FAIL (exit 1), at 4 seeds; the
    bf16 legs are the default run's, reused (their commands are the same)."""
    out = tmp_path / "out"
    for leg in ["bf16", "bf16-seed2", "bf16-seed3", "bf16-seed4"]:
        shutil.copytree(default_run[0] / leg, out / leg)
    proc = _parity(out, "--seeds", "4", break_fp8=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[bf16-seed4] reused" in proc.stdout
    summary = json.loads((out / "parity.json").read_text())
    assert summary["verdict"] == "FAIL" and summary["interval"][0] > summary["allowed"] and summary["fp8_gap"] > 0.1
    assert "FAIL: final validation loss fp8" in proc.stdout and "wholly outside the margin" in proc.stdout
