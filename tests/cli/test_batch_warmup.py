"""train.batch_size_warmup_tokens in whole runs of the trainer as a command (one process, CPU): the tokens each step
logs are the ramp's arithmetic, the startup line says the ramp, and a run stopped inside the ramp and resumed trains
the same steps as the uninterrupted run, bit for bit. The ramp's unit tests: tests/unit/test_batch_warmup.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, launch_ok, read_metrics

# batch_size=2 x seq_len=64: 128 tokens a microbatch. From 2 sequences (1 microbatch) to 2 x 4 over 512 tokens:
# count = 1 + 3 x T // 512 with T the tokens before the step: T = 0 -> 1, 128 -> 1 (384 // 512 = 0), 256 -> 1 + 1 = 2,
# 512 -> 4 (the ramp's end). A constant learning rate, so that a run of 2 steps resumed as one of 8 has the
# uninterrupted run's schedule.
RUN = ["--config", DEBUG_CONFIG, "--train.seq_len=64", "--train.mixed_precision=fp32", "--metrics.log_freq=1",
       "--metrics.enable_tensorboard=false", "--train.batch_size=2", "--train.grad_accum_steps=4",
       "--train.batch_size_warmup_tokens=512", "--train.batch_size_warmup_start=2", "--scheduler.decay_type=constant",
       "--scheduler.warmup_steps=1", "--train.deterministic=true"]
TOKENS = [128, 128, 256, 512, 512, 512, 512, 512]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    dump = tmp_path_factory.mktemp("uninterrupted")
    proc = launch_ok([*RUN, "--train.steps=8"], dump, timeout=240)
    return dump, proc.stdout + proc.stderr


def test_each_step_logs_the_tokens_of_the_ramp(uninterrupted) -> None:
    dump, output = uninterrupted
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["tokens"] for r in records] == TOKENS
    assert [r["tokens_seen"] for r in records] == [sum(TOKENS[:i + 1]) for i in range(8)]
    assert ("training steps 1-8, batch-size warm-up from 2 to 8 sequences per rank (1 to 4 microbatches of 2) over "
            "512 tokens, 3 steps of 128 to 256 tokens, then 512 tokens per step") in output
    steps = [line for line in output.splitlines() if "] step " in line]
    assert [("warm-up batch" in line) for line in steps] == [True, True, True] + [False] * 5
    assert "warm-up batch 256 tokens" in steps[2]


@pytest.mark.slow
def test_a_run_stopped_inside_the_ramp_resumes_it_exactly(uninterrupted, tmp_path: Path) -> None:
    """Stopped after step 2 (256 tokens trained: step 3 takes 2 microbatches), resumed to step 8: the same tokens
    and losses as the uninterrupted run, bit for bit (the ramp's position, TrainState.tokens, and the data
    position are both in the checkpoint)."""
    ref = {r["step"]: r for r in read_metrics(uninterrupted[0])}
    args = [*RUN, "--checkpoint.enable=true", "--checkpoint.interval=2"]
    launch_ok([*args, "--train.steps=2"], tmp_path, timeout=240)
    proc = launch_ok([*args, "--train.steps=8"], tmp_path, timeout=240)
    assert "at step 2" in proc.stdout + proc.stderr
    resumed = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(resumed) == list(range(1, 9))
    assert [resumed[s]["tokens"] for s in range(1, 9)] == TOKENS
    assert [resumed[s]["tokens_seen"] for s in range(3, 9)] == [ref[s]["tokens_seen"] for s in range(3, 9)]
    assert [resumed[s]["loss"] for s in range(1, 9)] == [ref[s]["loss"] for s in range(1, 9)]
