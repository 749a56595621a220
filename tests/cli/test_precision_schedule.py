"""train.precision_schedule in whole runs (the trainer as a command): bf16 -> fp8 -> bf16 inside one run equals
the manual three-launch sequence, a relaunch resumes the right phase, and a bad schedule on the command line is one
config error naming the key. Parsing, validation and the phase configs in-process:
tests/unit/test_precision_schedule.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import TRAIN, launch, launch_ok, read_metrics, run_until_paused
from tests.unit.test_precision_schedule import BASE, SCHEDULED
from trainer.config import load_job_config

# Every step bit-exact, fp8 ones included: on CPU fp8 runs aten's deterministic torch._scaled_mm, and the
# repo's fp8 tolerance (rel 1e-3, tests/distributed/test_float8_fsdp.py) would hide a leak of state between
# phases (oneDNN left off by the fp8 phase changed the last bf16 phase's losses by ~1e-4).


def _run(args: list[str], dump: Path) -> str:
    return launch_ok(args, dump, timeout=240).stdout


def _by_step(dump: Path, key: str) -> dict[int, float]:
    # A relaunch truncates metrics.jsonl after its resumed step, so each step appears once.
    records = read_metrics(dump)
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), steps
    return {r["step"]: r[key] for r in records}


def _assert_losses_match(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in got:
        assert got[step] == want[step], (step, got[step], want[step])


def _ordered(log: str, *lines: str) -> None:
    at = 0
    for line in lines:
        found = log.find(line, at)
        assert found >= 0, f"{line!r} not found (in this order) in:\n{log[-6000:]}"
        at = found + len(line)


def test_cli_reports_a_bad_schedule(tmp_path: Path) -> None:
    proc = launch([*BASE, "--train.precision_schedule=bf16:4,fp8:20,bf16", f"--job.dump_folder={tmp_path}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "config error: train.precision_schedule[1]='fp8:20': step 20 must be < train.steps=10 (the last entry, "
        "without a step, runs to train.steps)"
    )


# -- runs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory) -> tuple[Path, str]:
    """The scheduled run, uninterrupted: (dump folder, log)."""
    dump = tmp_path_factory.mktemp("scheduled")
    return dump, _run(SCHEDULED, dump)


@pytest.mark.slow
def test_scheduled_run_equals_manual_three_launches(scheduled, tmp_path: Path) -> None:
    dump, log = scheduled
    manual = tmp_path / "manual"
    # docs/checkpointing.md, pattern 3: the same run as three launches with checkpoints.
    _run([*BASE, "--train.steps=4", "--train.mixed_precision=bf16", "--scheduler.decay_type=constant"], manual)
    _run([*BASE, "--train.steps=8", "--train.mixed_precision=fp8", "--scheduler.decay_type=constant"], manual)
    _run([*BASE, "--train.steps=10", "--train.mixed_precision=bf16", "--scheduler.decay_type=wsd"], manual)

    # One metrics.jsonl, continued across the phases, equal to the three launches'.
    _assert_losses_match(_by_step(dump, "loss"), _by_step(manual, "loss"))
    # The scheduler saw the whole run: the same lr at every step as the manual sequence, decaying after step 8.
    lrs = _by_step(dump, "lr")
    assert lrs == _by_step(manual, "lr")
    assert lrs[10] < lrs[9] == lrs[8]
    _ordered(log, "precision schedule: bf16 steps 1-4, fp8 steps 5-8, bf16 steps 9-10",
             "saved checkpoint", "step-4", "precision schedule: step 4: bf16 -> fp8",
             "Applied Float8 training: recipe=TENSORWISE", "resumed bf16 checkpoint at step 4 with mixed_precision=fp8",
             "saved checkpoint", "step-8", "precision schedule: step 8: fp8 -> bf16",
             "resumed fp8 checkpoint at step 8 with mixed_precision=bf16", "training finished at step 10")
    assert log.count("Applied Float8 training") == 1  # only the fp8 phase converts
    assert "training finished" not in log.split("step 8: fp8 -> bf16")[0]
    assert not list(dump.glob("*.prev-*"))  # no phase moved the metrics aside
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-10", "step-4", "step-8"]
    written = {s: json.loads((dump / "checkpoint" / f"step-{s}" / "checkpoint.json").read_text())["mixed_precision"]
               for s in (4, 8, 10)}
    assert written == {4: "bf16", 8: "fp8", 10: "bf16"}
    # config.toml is the run's (relaunchable), not a phase's.
    saved = load_job_config(["--config", str(dump / "config.toml")])
    assert saved.train.precision_schedule == ["bf16:4", "fp8:8", "bf16"] and saved.checkpoint.load_step == -1


KILLED = [*SCHEDULED, "--checkpoint.interval=3"]  # saves at 3, 4 (boundary), 6, 8 (boundary), 9, 10


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The scheduled run SIGKILLed after step 7 (in the fp8 phase), before any cleanup: a dump folder to copy."""
    dump = tmp_path_factory.mktemp("killed")
    log = run_until_paused([sys.executable, TRAIN, *KILLED, f"--job.dump_folder={dump}"], "step:7", timeout=240)
    assert "step      7/10" in log
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-3", "step-4", "step-6"]
    return dump


@pytest.mark.slow
def test_relaunch_after_a_kill_in_the_fp8_phase_continues_in_fp8(scheduled, killed, tmp_path: Path) -> None:
    ref, _ = scheduled
    dump = tmp_path / "run"
    shutil.copytree(killed, dump)
    log = _run(KILLED, dump)  # the same command
    _ordered(log, "precision schedule: bf16 steps 1-4, fp8 steps 5-8, bf16 steps 9-10",
             "Applied Float8 training", "resumed from checkpoint", "step-6 at step 6 (saved with mixed_precision=fp8)",
             "precision schedule: resuming at step 6 in phase 2 of 3 (fp8 steps 5-8)",
             "step      7/10", "precision schedule: step 8: fp8 -> bf16", "training finished at step 10")
    assert "resumed fp8 checkpoint" not in log.split("step 8: fp8 -> bf16")[0]  # fp8 before the switch: no change
    _assert_losses_match(_by_step(dump, "loss"), _by_step(ref, "loss"))


@pytest.mark.slow
def test_fallback_past_corrupt_checkpoints_into_an_earlier_phase(scheduled, killed, tmp_path: Path) -> None:
    """step-6 (fp8 phase) and step-4 are corrupt: the relaunch falls back to step-3 and trains steps 4+ in bf16."""
    ref, _ = scheduled
    dump = tmp_path / "run"
    shutil.copytree(killed, dump)
    for step in (4, 6):
        shard = next((dump / "checkpoint" / f"step-{step}").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    log = _run(KILLED, dump)
    _ordered(log, "Applied Float8 training", "FELL BACK to", "step-3",
             "precision schedule: resumed step 3, which is in phase bf16 steps 1-4, not fp8 steps 5-8: rebuilding",
             "resumed from checkpoint", "step-3 at step 3 (saved with mixed_precision=bf16)",
             "precision schedule: resuming at step 3 in phase 1 of 3 (bf16 steps 1-4)", "step      4/10",
             "precision schedule: step 4: bf16 -> fp8", "Applied Float8 training", "training finished at step 10")
    _assert_losses_match(_by_step(dump, "loss"), _by_step(ref, "loss"))
