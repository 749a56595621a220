"""float8.recipe='blockwise' (emulated) under FSDP2 with bf16 all-gather and selective AC: 2 gloo ranks match
1 rank; and a checkpoint saved under tensorwise resumes under blockwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed, train_and_read_metrics
from tests.helpers import DEBUG_CONFIG, column, launch, read_metrics

ARGS = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=64", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp8", "--float8.recipe=blockwise",
        "--float8.emulate=true", "--train.activation_checkpointing=selective", "--train.batch_size=2"]


def test_blockwise_two_ranks_match_one_rank(tmp_path: Path) -> None:
    # 1 rank x 2 microbatches of 2 sequences sees, per microbatch, the 128 tokens each of 2 ranks sees: the same
    # 1x128 tiles and the same 128-token groups of the weight-gradient GEMM. Weights are all-gathered in bf16
    # ("auto" is off for blockwise) and the master weights are fp32 on both sides, so the layouts differ only
    # in the order the two microbatches' gradients are summed.
    fp32_master = ["--distributed.master_dtype=fp32"]
    one = run_distributed(train_and_read_metrics, world_size=1,
                          args=([*ARGS, *fp32_master, "--train.grad_accum_steps=2"], str(tmp_path / "one")))[0]
    two = run_distributed(train_and_read_metrics, world_size=2,
                          args=([*ARGS, *fp32_master, "--distributed.dp_shard=2"], str(tmp_path / "two")))[0]
    assert column(two, "loss") == pytest.approx(column(one, "loss"), rel=1e-3)
    assert column(two, "grad_norm") == pytest.approx(column(one, "grad_norm"), rel=1e-2)
    assert column(one, "fp8_converted_fraction") == [21 / 29] * 4


def _run(args: list[str], dump: Path) -> str:
    proc = launch([*args, f"--job.dump_folder={dump}"], timeout=240)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


# Checkpoints every 2 steps, a constant LR: the same learning rate at every step whatever train.steps is.
RUN = [*ARGS[:-2], "--train.batch_size=2", "--train.steps=5", "--train.deterministic=true", "--checkpoint.enable=true",
       "--checkpoint.interval=2", "--scheduler.warmup_steps=2", "--scheduler.decay_type=constant"]


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
