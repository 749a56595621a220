"""float8.recipe='blockwise' (emulated) through the trainer as a command: bf16 -> blockwise by
train.precision_schedule equals the same switch by relaunch, and a blockwise checkpoint resumes under tensorwise.
Blockwise under FSDP2, PP and EP against one rank (spawned functions): tests/distributed/test_float8_blockwise.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_float8_blockwise import ARGS
from tests.helpers import column, launch_ok, read_metrics


def _run(args: list[str], dump: Path) -> str:
    return launch_ok(args, dump, timeout=240).stdout


# Checkpoints every 2 steps, a constant LR: the same learning rate at every step whatever train.steps is.
RUN = [*ARGS[:-2], "--train.batch_size=2", "--train.steps=5", "--train.deterministic=true", "--checkpoint.enable=true",
       "--checkpoint.interval=2", "--scheduler.warmup_steps=2", "--scheduler.decay_type=constant"]


@pytest.mark.slow  # 4 whole-CLI launches
def test_precision_schedule_into_blockwise_and_resume_under_another_recipe(tmp_path: Path) -> None:
    """bf16 -> blockwise by train.precision_schedule equals the same switch by relaunch (bit for bit: emulated
    blockwise is deterministic on CPU); the blockwise checkpoint then resumes under tensorwise."""
    scheduled = _run([*RUN, "--train.precision_schedule=bf16:2,fp8"], tmp_path / "scheduled")
    assert "precision schedule: step 2: bf16 -> fp8" in scheduled
    assert "Applied Float8 training: recipe=BLOCKWISE, fsdp_float8_all_gather=False" in scheduled
    assert "resumed bf16 checkpoint at step 2 with mixed_precision=fp8" in scheduled
    manual = tmp_path / "manual"
    _run([*RUN, "--train.steps=2", "--train.mixed_precision=bf16"], manual)
    _run([*RUN, "--train.steps=4"], manual)
    want = column(read_metrics(tmp_path / "scheduled"), "loss")
    assert column(read_metrics(manual), "loss") == want[:4]
    # Step 5 from the blockwise checkpoint of step 4 under tensorwise: the same weights, optimizer state and
    # batch as the scheduled run's blockwise step 5, so the loss agrees to fp8 rounding, but not exactly.
    log = _run([*RUN, "--float8.recipe=tensorwise"], manual)
    assert "step-4 at step 4 (saved with mixed_precision=fp8)" in log and "Applied Float8 training: recipe=TENSORWISE" in log
    got = column(read_metrics(manual), "loss")
    assert got[:4] == want[:4] and got[4] != want[4] and got[4] == pytest.approx(want[4], rel=1e-2)
