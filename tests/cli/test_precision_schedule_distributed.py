"""train.precision_schedule on 2 gloo ranks (FSDP2, fp8 all-gather in the fp8 phase): the scheduled run equals
the manual three-launch sequence, and a relaunch after a kill in the fp8 phase resumes it on both ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, TRAIN, launch_ok, losses_by_step, run_until_paused

# wsd with the last 20% as decay: the manual sequence (constant, constant, wsd) has the same lr at every step.
BASE = [
    "--config", DEBUG_CONFIG, "--train.steps=10", "--train.seq_len=64", "--train.batch_size=2",
    "--train.deterministic=true", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true", "--checkpoint.interval=3", "--scheduler.warmup_steps=2",
    "--scheduler.wsd_decay_ratio=0.2", "--distributed.dp_shard=2",
]
SCHEDULED = [*BASE, "--train.precision_schedule=bf16:4,fp8:8,bf16", "--scheduler.decay_type=wsd"]


def _run(args: list[str], dump: Path) -> str:
    return launch_ok(args, dump, nproc=2, timeout=240).stdout


@pytest.mark.slow  # starts 2 processes per launch
def test_two_ranks_scheduled_equals_manual_and_resumes_the_fp8_phase(tmp_path: Path) -> None:
    _run(SCHEDULED, tmp_path / "scheduled")
    scheduled = losses_by_step(tmp_path / "scheduled")
    assert sorted(scheduled) == list(range(1, 11))

    manual = tmp_path / "manual"
    _run([*BASE, "--train.steps=4", "--train.mixed_precision=bf16", "--scheduler.decay_type=constant"], manual)
    _run([*BASE, "--train.steps=8", "--train.mixed_precision=fp8", "--scheduler.decay_type=constant"], manual)
    _run([*BASE, "--train.steps=10", "--train.mixed_precision=bf16", "--scheduler.decay_type=wsd"], manual)
    assert scheduled == losses_by_step(manual)  # bit-exact, fp8 phase included (the same layout and kernels)

    dump = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN, *SCHEDULED,
           f"--job.dump_folder={dump}"]
    run_until_paused(cmd, "step:7", timeout=240)  # both ranks SIGKILLed after step 7; the latest is step-6 (fp8)
    log = _run(SCHEDULED, dump)
    assert "precision schedule: resuming at step 6 in phase 2 of 3 (fp8 steps 5-8)" in log
    assert "precision schedule: step 8: fp8 -> bf16" in log
    assert losses_by_step(dump) == scheduled
