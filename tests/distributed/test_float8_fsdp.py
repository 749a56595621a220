"""FSDP2 with fp8 all-gather and precomputed scales on 2 gloo ranks (spawned functions) matches 1 rank (the CLI under
torchrun, which prints none of the libraries' noise: tests/cli/test_float8_fsdp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed, train_and_read_metrics, train_then_one_process
from tests.helpers import DEBUG_CONFIG, column

ARGS = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=64", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp8"]


def test_fp8_all_gather_two_ranks_match_one_rank(tmp_path: Path) -> None:
    # 1 rank x 2 microbatches of 2 sees, per microbatch, exactly what each of 2 ranks
    # sees, so the per-tensor activation scales are the same; weight scales are
    # global amaxes in both (precompute_float8_dynamic_scale_for_fsdp all-reduces).
    # fp8 all-gather (on one machine "auto" gathers in bf16); the 1-rank reference casts its weights the same way.
    # The 1-rank reference runs on rank 0 after the 2-rank run (spawn.train_then_one_process).
    two, one = run_distributed(train_then_one_process, world_size=2, args=(
        [*ARGS, "--train.batch_size=2", "--distributed.dp_shard=2", "--float8.enable_fsdp_float8_all_gather=true"],
        [*ARGS, "--train.batch_size=2", "--train.grad_accum_steps=2", "--float8.enable_fsdp_float8_all_gather=true"],
        str(tmp_path)))[0]
    assert column(two, "loss") == pytest.approx(column(one, "loss"), rel=1e-3)
    assert column(two, "grad_norm") == pytest.approx(column(one, "grad_norm"), rel=1e-2)
    # fp8 all-gather off: weight scales come from the amax of the bf16 copy instead of the
    # fp32 master shard (at most 2^-8 apart), so a few elements round to a neighbouring fp8
    # value: the first loss agrees to ~1e-3 and later ones drift slightly.
    off = run_distributed(train_and_read_metrics, world_size=2, args=(
        [*ARGS, "--train.batch_size=2", "--distributed.dp_shard=2", "--float8.enable_fsdp_float8_all_gather=false"],
        str(tmp_path / "off")))[0]
    assert column(off, "loss")[0] == pytest.approx(column(two, "loss")[0], rel=2e-3)
    assert column(off, "loss") == pytest.approx(column(two, "loss"), rel=1e-2)


@pytest.mark.slow
def test_fp8_all_gather_compiled_two_ranks_match_one_rank(tmp_path: Path) -> None:
    """Compiled, the loss hands the FP8 head its gradient already cast (trainer.loss.Float8HeadCrossEntropy), here
    with the head's weight arriving from FSDP2's all-gather already in float8: 2 ranks still track 1 rank."""
    compiled = [*ARGS, "--train.compile_model=true", "--float8.enable_fsdp_float8_all_gather=true"]
    two, one = run_distributed(train_then_one_process, world_size=2, args=(
        [*compiled, "--train.batch_size=2", "--distributed.dp_shard=2"],
        [*compiled, "--train.batch_size=2", "--train.grad_accum_steps=2"],
        str(tmp_path)))[0]
    assert column(two, "loss") == pytest.approx(column(one, "loss"), rel=1e-3)
    assert column(two, "grad_norm") == pytest.approx(column(one, "grad_norm"), rel=1e-2)
